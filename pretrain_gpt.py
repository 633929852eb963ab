"""Pretrain a GPT with megatron-core and the Full-Stack FP4 recipes.

    torchrun --nproc-per-node N pretrain_gpt.py --config configs/X.yaml [section.key=value ...]
    python pretrain_gpt.py --config configs/X.yaml --dry-run      # validate, build, count, exit

Bad input (config, data, checkpoint) prints one `error:` line and exits with code 2; a
divergence (the step guard gave up) exits with code 3 naming the checkpoint to resume from.
SIGTERM/SIGINT during training save a checkpoint and exit 0; during start-up (before the
first step: nothing to save) they stop the run with one line and exit 0.
"""
import argparse
import signal
import sys

from megatron.training.config import dump_yaml, load_config
from megatron.training.errors import UserError
from megatron.training.guards import DivergenceError


def parse_args(argv):
    from megatron.training.errors import ArgumentParser  # one `error:` line, exit 2

    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML run config")
    p.add_argument("--dry-run", action="store_true", help="validate, build the model on the meta device, print, exit")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.iters=100")
    return p.parse_args(argv)


def dry_run(cfg) -> None:
    from megatron.training.dry_run import describe

    print(dump_yaml(cfg), end="")
    print(describe(cfg))


class _StartupSignal(BaseException):
    """SIGTERM/SIGINT before the training loop installs its own handlers."""


def _on_startup_signal(signum, frame):
    raise _StartupSignal(signal.Signals(signum).name)


def main(argv=None) -> int:
    args = parse_args(argv)
    previous = {sig: signal.signal(sig, _on_startup_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        cfg = load_config(args.config, args.overrides)
        from megatron.training import cpu_compat

        cpu_compat.import_megatron_core()  # after the config: a config error needs no megatron-core
        if args.dry_run:
            dry_run(cfg)
            return 0
        from megatron.training.trainer import Trainer

        result = Trainer(cfg).train()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except DivergenceError as e:  # the message names the checkpoint to resume from
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 3
    except _StartupSignal as e:
        print(f"[train] {e} during start-up: stopped before the first step (nothing to save)", flush=True)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if "megatron.training.initialize" in sys.modules:  # config errors exit before any import of megatron.core
            sys.modules["megatron.training.initialize"].shutdown()
    if result.get("rank", 0) == 0:   # one line per job
        from megatron.training.metrics import done_line

        print(done_line(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
