"""What the GPU tests of the op share: seeded inputs and one forward + backward through the op."""

import torch

from cake_rmsnorm.accuracy import same_bits

EPS = 1e-6


def inputs(hidden: int, tokens: int, salt: int = 0) -> dict:
    """bf16 randn x, residual r, dy and dh; weight 1 + 0.1 randn as fp32 and as bf16."""
    gen = torch.Generator(device="cuda").manual_seed(hidden * 1_000_003 + tokens + salt)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

    w32 = 1 + 0.1 * randn(hidden, dtype=torch.float32)
    return dict(x=randn(tokens, hidden), r=randn(tokens, hidden), dy=randn(tokens, hidden),
                dh=randn(tokens, hidden), w={"fp32": w32, "bf16": w32.to(torch.bfloat16)})


def run(x, r, w, dy, dh, backend: str) -> dict:
    """Forward through the custom op (to see rstd), backward through autograd."""
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    if r is None:
        y, rstd = torch.ops.cake_rmsnorm.fwd(x, w, EPS, backend)
        h = None
        torch.autograd.backward([y], [dy])
    else:
        r = r.detach().requires_grad_()
        y, h, rstd = torch.ops.cake_rmsnorm.fwd_residual(x, r, w, EPS, backend)
        torch.autograd.backward([y, h], [dy, dh])
        assert same_bits(x.grad, r.grad), "dx of x and of residual differ"
    return dict(y=y.detach(), h=None if h is None else h.detach(), rstd=rstd.detach(),
                dx=x.grad, dw=w.grad)


def cases(inp: dict):
    """(residual, r, dh, xn, wname, w) for each residual setting and weight dtype of `inp`; xn is
    what the op normalises: h = bf16(x + r), as torch rounds it, or x."""
    x = inp["x"]
    for residual in (False, True):
        r, dh = (inp["r"], inp["dh"]) if residual else (None, None)
        xn = (x + r) if residual else x
        for wname, w in inp["w"].items():
            yield residual, r, dh, xn, wname, w
