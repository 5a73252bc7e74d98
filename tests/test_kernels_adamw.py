"""adamw_step: the Triton kernel (on CUDA, else in Triton's CPU interpreter) against the torch reference, and the
reference against torch.optim.AdamW.

Tolerances: kernel and reference do the same fp32 operations in the same order (the kernel with IEEE-rounded sqrt and
division), so from the same state one step's fp32 results agree to rtol 1e-6, atol 1e-7 (a few ulps: on a GPU the
compiler may fuse a multiply-add). A bf16 output is the same fp32 value rounded once: within one bf16 ulp (rtol 2**-7),
because Triton's interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even (on CUDA the stored bf16 param
is exactly master.to(bf16), tested below). One step, so that a truncated bf16 moment is not read back and compounded.
The reference is torch.optim.AdamW's single-tensor formulation and agrees with both of torch's fp32 implementations
(for-loop and foreach) to rtol 1e-6, atol 1e-7 over five steps, its bf16 param exactly master.to(bf16) after each.
Remainders (an int16 `master` beside a bf16 param) are exact: split and join are integer operations, so the master
they stand for is bit for bit the fp32 master the same kernel computes, step after step.
"""

import pytest
import torch
from kernels_interpreter import DEVICE, ON_CUDA, kernels_on_device  # noqa: F401  (first: before triton is imported)

import kernels.adamw
from kernels.adamw import adamw_step, adamw_step_reference, join_master, split_master

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)
N = 3000  # not a multiple of any config's block: the last block is partial
FP32 = dict(rtol=1e-6, atol=1e-7)
BF16 = dict(rtol=2 ** -7, atol=1e-7)


def state(n, grad_dtype, moment_dtypes, param_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g).to(grad_dtype)
    # nonzero moments, as after some steps, so that reading them matters
    exp_avg = (0.1 * torch.randn(n, generator=g)).to(moment_dtypes[0])
    exp_avg_sq = (0.01 * torch.rand(n, generator=g)).to(moment_dtypes[1])
    param = None if param_dtype is None else master.to(param_dtype)
    return [t if t is None else t.to(DEVICE) for t in (master, grad, exp_avg, exp_avg_sq, param)]


def assert_state_close(got, want):
    for a, b in zip(got, want):
        if a is not None:
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, **(FP32 if a.dtype == torch.float32 else BF16))


MOMENTS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]


def dtype_id(value):
    return str(value).replace("torch.", "") if isinstance(value, torch.dtype) else None


@pytest.mark.parametrize("weight_decay", [0.0, 0.1], ids=["wd0", "wd0.1"])
@pytest.mark.parametrize("divisor", [None, 2.5], ids=["no_divisor", "divisor"])
@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16, torch.float32], ids=lambda d: f"param_{dtype_id(d)}")
@pytest.mark.parametrize("moment_dtypes", MOMENTS, ids=lambda m: f"m_{dtype_id(m[0])}-v_{dtype_id(m[1])}")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=lambda d: f"grad_{dtype_id(d)}")
def test_kernel_matches_reference(grad_dtype, moment_dtypes, param_dtype, divisor, weight_decay):
    got = state(N, grad_dtype, moment_dtypes, param_dtype)
    want = [t if t is None else t.clone() for t in got]
    grad_before = got[1].clone()
    div = None if divisor is None else torch.tensor(divisor, device=DEVICE)
    adamw_step(*got, **HYPER, weight_decay=weight_decay, step=3, grad_divisor=div)
    adamw_step_reference(*want, **HYPER, weight_decay=weight_decay, step=3, grad_divisor=div)
    assert_state_close(got, want)
    assert torch.equal(got[1], grad_before), "grad is read only"


def with_remainders(tensors):
    """The same state with the fp32 master as int16 remainders of the bf16 param."""
    master, grad, exp_avg, exp_avg_sq, _ = tensors
    param, remainder = split_master(master.clone())
    return [remainder, grad.clone(), exp_avg.clone(), exp_avg_sq.clone(), param]


@pytest.mark.parametrize("moment_dtypes", MOMENTS[:2], ids=lambda m: f"m_{dtype_id(m[0])}-v_{dtype_id(m[1])}")
@pytest.mark.parametrize("fn", [adamw_step, adamw_step_reference], ids=["kernel", "reference"])
def test_remainders_stand_for_the_fp32_master_bit_for_bit_over_steps(fn, moment_dtypes):
    """From the same state, the remainder path's joined master is exactly the fp32-master path's, step after step,
    and its param is that master split (rounded to nearest, ties away from zero)."""
    fp32 = state(N, torch.bfloat16, moment_dtypes, torch.bfloat16)
    rem = with_remainders(fp32)
    div = torch.tensor(1.5, device=DEVICE)
    for step in range(1, 4):
        for tensors in (fp32, rem):
            fn(*tensors, **HYPER, weight_decay=0.1, step=step, grad_divisor=div)
        assert torch.equal(join_master(rem[4], rem[0]).view(torch.int32), fp32[0].view(torch.int32))
        assert torch.equal(rem[4].view(torch.int16), split_master(fp32[0])[0].view(torch.int16))
        for a, b in zip(rem[2:4], fp32[2:4]):
            assert torch.equal(a, b)


def test_remainder_kernel_matches_reference():
    got = with_remainders(state(N, torch.bfloat16, MOMENTS[1], torch.bfloat16))
    want = [t.clone() for t in got]
    adamw_step(*got, **HYPER, weight_decay=0.1, step=3, grad_divisor=torch.tensor(2.0, device=DEVICE))
    adamw_step_reference(*want, **HYPER, weight_decay=0.1, step=3, grad_divisor=torch.tensor(2.0, device=DEVICE))
    torch.testing.assert_close(join_master(got[4], got[0]), join_master(want[4], want[0]), **FP32)


def special_values() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(100_000, generator=g) * torch.logspace(-40, 38, 100_000)  # denormals to near the max
    edges = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38, float("inf"), -float("inf")])
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x00008000, 0x7F7F8000], dtype=torch.int32)  # low half 0x8000
    ties = torch.cat([ties, ties | -0x80000000]).view(torch.float32)
    return torch.cat([spread, edges, ties])


def test_split_then_join_is_exact_and_the_param_is_rounded_to_nearest():
    x = special_values()
    param, remainder = split_master(x)
    assert torch.equal(join_master(param, remainder).view(torch.int32), x.view(torch.int32))
    rne, ours = x.bfloat16().view(torch.int16), param.view(torch.int16)
    ties = (x.view(torch.int32) & 0xFFFF) == 0x8000
    assert torch.equal(ours[~ties], rne[~ties]), "away from ties, round to nearest even"
    up = (x.view(torch.int32)[ties] >> 16) + 1  # ties away from zero: the magnitude's upper half + 1
    assert torch.equal(ours[ties], up.to(torch.int16))
    assert torch.equal(param[x.isinf()], x[x.isinf()].bfloat16())


def test_split_and_join_name_bad_dtypes():
    with pytest.raises(ValueError, match="fp32"):
        split_master(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="int16 remainder"):
        join_master(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.int32))


@pytest.mark.parametrize("foreach", [False, True])
def test_reference_matches_torch_adamw_over_five_steps(foreach):
    torch.manual_seed(0)
    n, wd, divisor = 1000, 0.1, torch.tensor(3.0)
    weight = torch.nn.Parameter(torch.randn(n))
    opt = torch.optim.AdamW([weight], **{"lr": HYPER["lr"], "betas": (HYPER["beta1"], HYPER["beta2"]),
                                         "eps": HYPER["eps"]}, weight_decay=wd, foreach=foreach)
    master, exp_avg, exp_avg_sq = weight.detach().clone(), torch.zeros(n), torch.zeros(n)
    param = master.to(torch.bfloat16)
    for step in range(1, 6):
        grad = torch.randn(n)
        weight.grad = grad / divisor
        opt.step()
        adamw_step_reference(master, grad, exp_avg, exp_avg_sq, param, **HYPER, weight_decay=wd, step=step,
                             grad_divisor=divisor)
        s = opt.state[weight]
        torch.testing.assert_close(master, weight.detach(), **FP32)
        torch.testing.assert_close(exp_avg, s["exp_avg"], **FP32)
        torch.testing.assert_close(exp_avg_sq, s["exp_avg_sq"], **FP32)
        assert torch.equal(param, master.to(torch.bfloat16))


@pytest.mark.skipif(not ON_CUDA, reason="Triton 3.6's interpreter truncates fp32 -> bf16 stores; compiled kernels "
                                        "round to nearest even, as torch does")
def test_kernel_over_steps_keeps_bf16_param_equal_to_rounded_master():
    master, grad, exp_avg, exp_avg_sq, param = state(N, torch.bfloat16, MOMENTS[0], torch.bfloat16)
    for step in range(1, 4):
        adamw_step(master, grad, exp_avg, exp_avg_sq, param, **HYPER, weight_decay=0.1, step=step)
        assert torch.equal(param, master.to(torch.bfloat16))


def test_plain_cpu_runs_the_reference(monkeypatch):
    calls = []
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(kernels.adamw, "adamw_step_reference", lambda *args, **kwargs: calls.append(args))
    tensors = [t.cpu() for t in state(10, torch.float32, MOMENTS[0], None)[:4]]
    adamw_step(*tensors, **HYPER, weight_decay=0.0, step=1)
    assert len(calls) == 1


def bad_calls():
    def t(n=8, dtype=torch.float32):
        return torch.zeros(n, dtype=dtype)

    ok = dict(master=t(), grad=t(), exp_avg=t(), exp_avg_sq=t())
    return [  # (the argument the message must name, what is wrong, the call's tensors)
        ("master", "bf16", dict(ok, master=t(dtype=torch.bfloat16))),
        ("param", "remainders_without_bf16_param", dict(ok, master=t(dtype=torch.int16))),
        ("param", "remainders_of_fp32_param", dict(ok, master=t(dtype=torch.int16), param=t())),
        ("grad", "fp16", dict(ok, grad=t(dtype=torch.float16))),
        ("exp_avg", "fp16", dict(ok, exp_avg=t(dtype=torch.float16))),
        ("exp_avg_sq", "shape", dict(ok, exp_avg_sq=t(9))),
        ("param", "int32", dict(ok, param=t(dtype=torch.int32))),
        ("param", "shape", dict(ok, param=t(9, torch.bfloat16))),
        ("grad", "non_contiguous", dict(ok, grad=torch.zeros(8, 2)[:, 0])),
        ("exp_avg", "device", dict(ok, exp_avg=t().to("meta"))),
        ("grad_divisor", "not_0d", dict(ok, grad_divisor=torch.ones(1))),
        ("grad_divisor", "fp64", dict(ok, grad_divisor=torch.tensor(1.0, dtype=torch.float64))),
        ("grad_divisor", "device", dict(ok, grad_divisor=torch.tensor(1.0, device="meta"))),
        ("step", "zero", dict(ok, step=0)),
    ]


@pytest.mark.parametrize("name,why,kwargs", bad_calls(), ids=[f"{name}-{why}" for name, why, _ in bad_calls()])
@pytest.mark.parametrize("fn", [adamw_step, adamw_step_reference], ids=["kernel", "reference"])
def test_bad_arguments_name_the_argument(fn, name, why, kwargs):
    kwargs = dict(dict(HYPER, weight_decay=0.0, step=1), **kwargs)
    with pytest.raises(ValueError, match=f"`{name}`"):
        fn(**kwargs)
