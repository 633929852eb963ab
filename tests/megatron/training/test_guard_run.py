"""The step guard inside a real run: a diverging run skips its NaN updates, then stops without
saving the diverged parameters (tests/megatron/training/test_reliability.py covers the resume)."""
import json
import os

from tests.megatron.training import helpers


def test_nonfinite_updates_are_skipped_then_run_stops_naming_what_to_resume(tmp_path):
    d = str(tmp_path)
    # lr 1e30: the first (clipped) update blows the weights up, so every later loss and grad
    # norm is non-finite. The guard must skip those updates, report each, and after
    # max_consecutive_skips exit 3 with one error line.
    p = helpers.start(helpers.base_config(d), [
        "train.iters=20", "optimizer.lr=1e30", "optimizer.min_lr=0", "optimizer.warmup_iters=0",
        "optimizer.schedule=constant", "train.max_consecutive_skips=3", "train.eval_interval=100",
        f"checkpoint.save_dir={d}/ckpt", f"logging.dir={d}/log"], log=os.path.join(d, "out.txt"))
    rc, out = helpers.finish(p, timeout=300)
    assert rc == 3, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "3 consecutive optimizer updates skipped" in errors[0], out[-3000:]
    skipped = [ln for ln in out.splitlines() if ln.startswith("[guard]")]
    assert len(skipped) == 3 and all("nonfinite" in ln for ln in skipped), skipped
    records = [json.loads(ln) for ln in open(os.path.join(d, "log", "metrics.jsonl"))]
    train = {r["iter"]: r for r in records if "loss" in r}
    assert train[1]["skipped"] == 0 and train[4]["total_skips"] == 3
    # the parameters in memory are those after step 1, the destructive one: nothing is saved,
    # and with no checkpoint from before it the message says to start again
    assert "no checkpoint from before the divergence exists" in errors[0], errors[0]
    assert not [n for n in os.listdir(os.path.join(d, "ckpt")) if n.startswith("iter_")]
