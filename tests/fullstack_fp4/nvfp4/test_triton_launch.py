"""The lean launcher (fullstack_fp4/nvfp4/kernels/launch.py) on the CPU.

The launch through a compiled kernel needs a GPU; ``benchmarks/profile/check_kernels_exact.py`` checks
there that it launches the very kernel ``JITFunction.run`` picks, bit for bit. Here: the
argument binding against ``inspect``'s, the cache key against what Triton specialises on
(written out by hand from Triton's rules), the glue with a stand-in compiled kernel, and the
plain path under the interpreter.
"""

import inspect

import pytest
import torch

from fullstack_fp4.nvfp4.kernels import launch as tl_launch
from fullstack_fp4.nvfp4.kernels.amax import _amax_two_ways_kernel
from fullstack_fp4.nvfp4.kernels.quantize_two_ways import _quantize_two_ways_kernel


def _inspect_bind(fn, args, kwargs):
    params = inspect.signature(fn.fn).parameters
    own = {k: v for k, v in kwargs.items() if k in params}
    bound = inspect.signature(fn.fn).bind(*args, **own)
    bound.apply_defaults()
    return list(bound.arguments.values()), {k: v for k, v in kwargs.items() if k not in params}


@pytest.mark.parametrize("n_positional", [0, 3, 5, 11])
def test_bind_matches_inspect(n_positional):
    names = list(inspect.signature(_amax_two_ways_kernel.fn).parameters)
    values = [object() for _ in names]           # identity: the order must be exact
    args = tuple(values[:n_positional])
    kwargs = dict(zip(names[n_positional:], values[n_positional:]))
    kwargs.update(num_warps=4, enable_fp_fusion=False)
    got = tl_launch.bind_arguments(_amax_two_ways_kernel, args, kwargs)
    want = _inspect_bind(_amax_two_ways_kernel, args, kwargs)
    assert [id(v) for v in got[0]] == [id(v) for v in want[0]] == [id(v) for v in values]
    assert got[1] == want[1] == {"num_warps": 4, "enable_fp_fusion": False}


def test_bind_errors():
    with pytest.raises(TypeError, match="missing argument 'BLOCK'"):
        tl_launch.bind_arguments(_amax_two_ways_kernel, (1, 2, 3, 4, 5),
                                 dict(SIGNS=0, ROW=True, COL=True, XW=True, I64=False))
    with pytest.raises(TypeError, match="given twice"):
        tl_launch.bind_arguments(_amax_two_ways_kernel, (1, 2), dict(obs_ptr=2))


def test_constexpr_parameters_hand_listed():
    sig = tl_launch._signature(_amax_two_ways_kernel)
    got = [n for n, c in zip(sig.names, sig.constexpr) if c]
    assert got == ["SIGNS", "ROW", "COL", "XW", "I64", "BLOCK", "TBS", "EVEN"]
    sig = tl_launch._signature(_quantize_two_ways_kernel)
    assert sig.names[17:19] == ["stride_t", "SIGNS"] and len(sig.names) == 35
    assert not any(sig.constexpr[:18]) and all(sig.constexpr[18:])


def _key(values, options=None, device=0):
    """The key launch() uses for a call with these parameter values (by position)."""
    return tl_launch.specialization_key(_amax_two_ways_kernel, tuple(values), options or {},
                                        device)


def _values(x, t=64, c=32, stride=32, block=16):
    return [x, torch.zeros(2, dtype=torch.int32), t, c, stride, 0, True, True, True, False, block,
            2, False]


def test_key_equal_when_triton_would_reuse_the_kernel():
    # other data, other values with the same specialisation (not 1, same divisibility, i32)
    a = torch.zeros(256, dtype=torch.bfloat16)
    b = torch.ones(512, dtype=torch.bfloat16)
    assert a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
    assert _key(_values(a, t=64, c=32)) == _key(_values(b, t=4096, c=3072))
    assert _key(_values(a, t=17)) == _key(_values(b, t=33))


@pytest.mark.parametrize("change", [
    dict(x=torch.zeros(256, dtype=torch.float32)),            # dtype
    dict(x=torch.zeros(256, dtype=torch.bfloat16)[1:]),       # 16-byte alignment
    dict(t=1),                                                 # == 1
    dict(t=63),                                                # divisibility by 16
    dict(stride=2 ** 31),                                      # 64-bit int
    dict(block=32),                                            # a constexpr's value
])
def test_key_differs_where_triton_specialises(change):
    base = dict(x=torch.zeros(256, dtype=torch.bfloat16), t=64, c=32, stride=32, block=16)
    assert _key(_values(**base)) != _key(_values(**{**base, **change}))


def test_key_differs_by_options_device_and_arg_kind():
    v = _values(torch.zeros(256, dtype=torch.bfloat16))
    assert _key(v, {"num_warps": 4}) != _key(v, {"num_warps": 8})
    assert _key(v, device=0) != _key(v, device=1)
    assert tl_launch._arg_key(True) != tl_launch._arg_key(1)
    assert tl_launch._arg_key(2 ** 63) != tl_launch._arg_key(2 ** 62)
    with pytest.raises(tl_launch._Unkeyed):
        tl_launch._arg_key((1, 2))


class _FakeCompiled:
    """Stands in for a CompiledKernel: records what its C launcher would get."""
    function, packed_metadata = "fn-handle", "meta"

    def __init__(self):
        self.calls = []

    def run(self, *a):
        self.calls.append(a)


class _FakeJit:
    """Stands in for a JITFunction: counts the plain launches, returns one compiled kernel."""

    def __init__(self, fn):
        self.fn, self.constexprs, self.__name__ = fn, [2], fn.__name__
        self.compiled, self.plain = _FakeCompiled(), []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.plain.append((grid, args, kwargs))
            return self.compiled
        return run


def _kernel(x_ptr, n, BLOCK, flag=7):
    pass


def _lean_on_cpu(monkeypatch, mode="1"):
    """The lean path with a stand-in kernel: no interpreter, no hooks, device 0."""
    monkeypatch.setattr(tl_launch, "_INTERPRET", False)
    monkeypatch.setattr(tl_launch, "_MODE", mode)
    monkeypatch.setattr(tl_launch, "_hooks_idle", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1234, raising=False)


def test_launch_glue_with_a_stand_in_kernel(monkeypatch):
    _lean_on_cpu(monkeypatch)
    fake = _FakeJit(_kernel)
    x = torch.zeros(8)
    tl_launch.launch(fake, (3,), x, 5, BLOCK=64, num_warps=4)        # first: the plain way
    assert len(fake.plain) == 1 and fake.compiled.calls == []
    y = torch.zeros(16)
    tl_launch.launch(fake, (9, 2), y, 6, BLOCK=64, num_warps=4)      # then straight through
    assert len(fake.plain) == 1
    assert fake.compiled.calls == [(9, 2, 1, 1234, "fn-handle", "meta", None, None, None,
                                    y, 6, 64, 7)]
    tl_launch.launch(fake, (9,), y, n=6, BLOCK=64, num_warps=4)      # other call shape: plain
    tl_launch.launch(fake, (9,), y, n=7, BLOCK=64, num_warps=4)      # once, then lean
    assert len(fake.plain) == 2 and fake.compiled.calls[-1][-4:] == (y, 7, 64, 7)
    del fake.plain[-1], fake.compiled.calls[-1]
    tl_launch.launch(fake, (9,), y, 6, BLOCK=128, num_warps=4)       # new constexpr: plain
    assert len(fake.plain) == 2
    tl_launch.launch(fake, (9,), y, 6, BLOCK=64, num_warps=8)        # new option: plain
    assert len(fake.plain) == 3
    tl_launch.launch(fake, (9,), y, 6, BLOCK=64, num_warps=4, flag=(1,))   # unkeyed: plain
    assert len(fake.plain) == 4 and len(fake.compiled.calls) == 1
    assert tl_launch.compiled_for(fake, y, 6, BLOCK=64, num_warps=4) is fake.compiled
    assert tl_launch.compiled_for(fake, y, 6, BLOCK=32, num_warps=4) is None


def test_modes(monkeypatch):
    monkeypatch.setattr(tl_launch, "_MODE", "1")
    monkeypatch.setattr(tl_launch, "_INTERPRET", True)
    assert not tl_launch.lean_enabled()
    monkeypatch.setattr(tl_launch, "_INTERPRET", False)
    assert tl_launch.lean_enabled()
    assert tl_launch.set_mode("0") == "1" and not tl_launch.lean_enabled()
    assert tl_launch.set_mode("verify") == "0" and tl_launch.lean_enabled()
    with pytest.raises(ValueError, match="mode"):
        tl_launch.set_mode("fast")
    fake = _FakeJit(_kernel)
    monkeypatch.setattr(tl_launch, "_INTERPRET", True)     # the interpreter: always plain
    tl_launch.launch(fake, (1,), torch.zeros(8), 5, BLOCK=64)
    tl_launch.launch(fake, (1,), torch.zeros(8), 5, BLOCK=64)
    assert len(fake.plain) == 2 and fake.compiled.calls == []


def test_verify_mode_catches_a_kernel_triton_would_not_pick(monkeypatch):
    _lean_on_cpu(monkeypatch, mode="verify")
    fake = _FakeJit(_kernel)
    picks = []
    fake.run = lambda *a, grid, warmup, **kw: picks.append(warmup) or fake.compiled
    x = torch.zeros(8)
    tl_launch.launch(fake, (1,), x, 5, BLOCK=64)
    tl_launch.launch(fake, (1,), x, 6, BLOCK=64)
    assert picks == [True] and len(fake.compiled.calls) == 1
    fake.run = lambda *a, grid, warmup, **kw: _FakeCompiled()     # triton would pick another
    with pytest.raises(RuntimeError, match="not the one"):
        tl_launch.launch(fake, (1,), x, 7, BLOCK=64)


_KERNEL_MODULES = ["fullstack_fp4.nvfp4.kernels.quantize",
                   "fullstack_fp4.nvfp4.kernels.quantize_two_ways",
                   "fullstack_fp4.nvfp4.kernels.amax", "fullstack_fp4.nvfp4.kernels.decode",
                   "fullstack_fp4.nvfp4.kernels.gemm_epilogue",
                   "fullstack_fp4.optim.q_adamw.triton_step", "fullstack_fp4.optim.triton_ns",
                   "fullstack_fp4.attention.triton_fwd", "fullstack_fp4.attention.triton_bwd",
                   "fullstack_fp4.attention.triton_prologue", "fullstack_fp4.attention.triton_unpack"]


def test_seed_arguments_are_not_specialised():
    """A kernel argument that takes a fresh random seed every call must be ``do_not_specialize``:
    otherwise the first seed divisible by 16 (1 call in 16) or equal to 1 compiles another
    variant of the kernel in the middle of training (seconds; minutes for Q-Attn's backward).
    The oracle is the parameter names: every ``seed*`` parameter of every ``*_kernel``."""
    import importlib

    checked = 0
    for mod_name in _KERNEL_MODULES:
        mod = importlib.import_module(mod_name)
        for name, fn in vars(mod).items():
            if not name.endswith("_kernel") or not hasattr(fn, "fn"):
                continue
            if getattr(fn.fn, "__module__", None) != mod_name:
                continue
            seeds = [p for p in inspect.signature(fn.fn).parameters if p.startswith("seed")]
            dns = getattr(fn, "do_not_specialize", None)
            if dns is None:                              # the interpreter's wrapper
                dns = fn.kwargs.get("do_not_specialize", [])
            for p in seeds:
                assert p in dns, f"{mod_name}.{name}: seed argument {p!r} is specialised"
                checked += 1
    assert checked >= 7      # two-ways ×2, quantize, philox, Q-Attn dK/dV + dQ, Q-AdamW


def test_grid_arithmetic_matches_triton():
    import triton

    for a in range(0, 600, 7):
        for b in (1, 3, 16, 64, 512):
            assert tl_launch.cdiv(a, b) == triton.cdiv(a, b)
    for n in range(1, 5000):
        assert tl_launch.next_pow2(n) == triton.next_power_of_2(n)
    assert tl_launch.next_pow2(0) == 1        # at least one block (Triton's gives 0)
