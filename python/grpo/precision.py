"""python -m grpo.precision: dW and dhidden error against a float64 reference, grpo beside torch eager (bf16).

Issue 19, item 3. One problem (grpo.bench's workload recipe: hidden ~ N(0, 1),
W ~ N(0, 3 / sqrt(H)), old_logp = logp + N(0, 0.3), per-token advantages),
its gradients computed three ways:

  grpo    grpo.torch.lm_head_grpo_loss in the inputs' dtype: f32 logits
          tiles, bf16 dlogits, dW written in bf16 by the kernel (accumulated
          over token blocks), dhidden in bf16
  eager   torch eager autograd in the inputs' dtype: logits = hidden W^T as
          one bf16 GEMM (f32 accumulation, rounded to bf16 logits), TRL's
          selective_log_softmax, the loss, autograd (dW one GEMM, one rounding)
  ref     float64 on samples: the log-sum-exp of every row from chunked
          float64 (or --lse-dtype f32) GEMMs over the whole vocabulary, the
          coefficient c_t = dLoss/dlogp_t by float64 autograd of the same
          loss, then dhidden on --rows sampled token rows (dh_t = c_t (W_y -
          p_t W)) and dW on --cols sampled vocabulary rows (dW_v = sum_t c_t
          ([y_t = v] - p_tv) h_t), all of H

and reported per gradient: the max abs error over the sampled entries
relative to their max |ref|, and the relative L2 error ||got - ref|| /
||ref||, beside the error of ref itself rounded to bf16 (the floor any bf16
gradient has). --dtype f16 runs the same in float16 (grpo: f32 dlogits,
gradients written in fp16; eager: float16 GEMMs and gradients) beside the
reference rounded to fp16. The sampled vocabulary rows are half chosen tokens (whose
one-hot term enters dW) and half uniform.

    python -m grpo.precision                          # T=8192 H=4096 V=151936 bf16: run alone, ~20 GB, long
    python -m grpo.precision --shape 1,256,512,8192   # a check in seconds
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from grpo.bench import EPS, WORKLOADS, _parse_shape, _torch_loss, cpu_model, make_inputs


def _sampled(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return x.detach()[idx].double()


def reference_lse(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, rows: int = 512,
                  cols: int = 16384) -> torch.Tensor:
    """LSE of every row of hidden W^T, computed in `dtype` GEMM chunks and a float64 online reduction."""
    h = hidden.detach().reshape(-1, hidden.shape[-1])
    w = weight.detach()
    n, v = h.shape[0], w.shape[0]
    lse = torch.empty(n, dtype=torch.float64)
    wc = [w[c0:c0 + cols].to(dtype) for c0 in range(0, v, cols)]
    for r0 in range(0, n, rows):
        hr = h[r0:r0 + rows].to(dtype)
        m = torch.full((hr.shape[0],), -math.inf, dtype=torch.float64)
        s = torch.zeros(hr.shape[0], dtype=torch.float64)
        for tile in wc:
            z = (hr @ tile.T).double()
            m_new = torch.maximum(m, z.max(dim=1).values)
            s = s * torch.exp(m - m_new) + torch.exp(z - m_new[:, None]).sum(dim=1)
            m = m_new
        lse[r0:r0 + rows] = m + torch.log(s)
    return lse


def measure(b: int, t: int, h: int, v: int, dtype_name: str, workload: str, n_rows: int, n_cols: int,
            lse_dtype: str, seed: int = 0, threads: int | None = None, token_block: int | None = None,
            eager: bool = True) -> dict:
    import grpo.torch as gt
    from trl.trainer.utils import selective_log_softmax

    if threads:
        torch.set_num_threads(threads)
    x = make_inputs(b, t, h, v, dtype_name, workload, seed=seed)
    hidden, weight, ids, mask, adv, old, ref = (x[k] for k in ("hidden", "weight", "ids", "mask", "adv", "old", "ref"))
    loss_type, beta = x["loss_type"], x["beta"]
    num_items = float(mask.sum())
    g = torch.Generator().manual_seed(seed + 1)
    n = b * t
    row_idx = torch.randperm(n, generator=g)[:n_rows].sort().values
    chosen = torch.unique(ids.reshape(-1))
    half = min(n_cols // 2, chosen.numel())
    col_idx = torch.unique(torch.cat([chosen[torch.randperm(chosen.numel(), generator=g)[:half]],
                                      torch.randint(0, v, (n_cols - half,), generator=g)]))
    timings = {}

    # grpo.
    start = time.perf_counter()
    out = gt.lm_head_grpo_loss(hidden, weight, ids, mask, adv, old_logp=old, ref_logp=ref, loss_type=loss_type,
                               beta=beta, epsilon_low=EPS, epsilon_high=EPS,
                               num_items_in_batch=num_items if loss_type == "dapo" else None,
                               token_block=token_block)
    out.loss.backward()
    timings["grpo_s"] = time.perf_counter() - start
    grpo_dh = _sampled(hidden.grad.reshape(n, h), row_idx)
    grpo_dw = _sampled(weight.grad, col_idx)
    hidden.grad = weight.grad = None
    del out

    # torch eager (the inputs' dtype throughout, as an eager trainer runs it).
    eager_dh = eager_dw = None
    if eager:
        start = time.perf_counter()
        logits = hidden @ weight.T
        logp = selective_log_softmax(logits, ids)
        _torch_loss(logp, old, ref, adv, mask, loss_type, beta).backward()
        del logits, logp
        timings["eager_s"] = time.perf_counter() - start
        eager_dh = _sampled(hidden.grad.reshape(n, h), row_idx)
        eager_dw = _sampled(weight.grad, col_idx)
        hidden.grad = weight.grad = None

    # float64 reference on the samples.
    start = time.perf_counter()
    h64 = hidden.detach().reshape(n, h).double()
    w64 = weight.detach().double() if v * h <= (1 << 28) else None  # 2 GB of f64 at most
    lse = reference_lse(hidden, weight, {"f64": torch.float64, "f32": torch.float32}[lse_dtype])
    ids_flat = ids.reshape(-1)
    w_y = weight.detach()[ids_flat].double()
    z_y = (h64 * w_y).sum(dim=1)
    logp64 = (z_y - lse).requires_grad_()
    old64 = None if old is None else old.double()
    ref64 = None if ref is None else ref.double()
    loss64 = _torch_loss(logp64.view(b, t), old64, ref64, adv.double(), mask.double(), loss_type, beta)
    if loss_type == "dapo":
        loss64 = loss64 * (mask.sum().clamp(min=1.0).double() / num_items)
    (c,) = torch.autograd.grad(loss64, logp64)
    c = c.detach()
    # dhidden rows: c_t (W_y - p_t W), p_t over the whole vocabulary.
    ref_dh = torch.empty(len(row_idx), h, dtype=torch.float64)
    for i, r in enumerate(row_idx.tolist()):
        w_full = w64 if w64 is not None else weight.detach().double()
        p = torch.exp(w_full @ h64[r] - lse[r])
        ref_dh[i] = c[r] * (w_y[r] - p @ w_full)
    # dW rows: sum_t c_t ([y_t = v] - p_tv) h_t.
    w_cols = weight.detach()[col_idx].double()
    p_cols = torch.exp(h64 @ w_cols.T - lse[:, None])  # [N, cols]
    onehot = (ids_flat[:, None] == col_idx[None, :]).double()
    ref_dw = ((onehot - p_cols) * c[:, None]).T @ h64
    timings["reference_s"] = time.perf_counter() - start

    def errors(got, want):
        if got is None:
            return None
        diff = got - want
        return {"max_abs_rel": float(diff.abs().max() / want.abs().max()),
                "rel_l2": float(diff.norm() / want.norm())}

    rounding = {"bf16": torch.bfloat16, "f16": torch.float16}.get(dtype_name, torch.float32)
    table = {
        "dhidden": {"grpo": errors(grpo_dh, ref_dh), "eager": errors(eager_dh, ref_dh),
                    "ref_rounded": errors(ref_dh.to(rounding).double(), ref_dh)},
        "dweight": {"grpo": errors(grpo_dw, ref_dw), "eager": errors(eager_dw, ref_dw),
                    "ref_rounded": errors(ref_dw.to(rounding).double(), ref_dw)},
    }
    return {"B": b, "T": t, "H": h, "V": v, "dtype": dtype_name, "workload": workload, "rows": len(row_idx),
            "token_block": token_block, "grpo_blocks": math.ceil(n / max(1, token_block or n)),
            "cols": len(col_idx), "lse_dtype": lse_dtype, "cpu_model": cpu_model(), "errors": table, **timings}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo.precision", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=_parse_shape, default=(1, 8192, 4096, 151936),
                        help="quick, headline or B,T,H,V (default headline: 1,8192,4096,151936)")
    parser.add_argument("--dtype", choices=("bf16", "f16", "f32"), default="bf16",
                        help="of hidden, weight and the gradients (f16: f32 dlogits, gradients written in fp16)")
    parser.add_argument("--workload", choices=tuple(WORKLOADS), default="offpolicy")
    parser.add_argument("--rows", type=int, default=64, help="sampled token rows of dhidden")
    parser.add_argument("--cols", type=int, default=64, help="sampled vocabulary rows of dW")
    parser.add_argument("--lse-dtype", choices=("f64", "f32"), default="f64",
                        help="the reference's full-vocabulary GEMMs for the log-sum-exp (f32: far faster; its "
                             "~1e-6 relative LSE error is far below bf16's 2^-9)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--token-block", type=int, default=None,
                        help="grpo's token block (default: the plan's choice; smaller = more bf16 roundings of dW)")
    parser.add_argument("--no-eager", action="store_true",
                        help="leave torch eager out (its float16 GEMMs on a CPU without AVX512-FP16 are slow: "
                             "634 s against grpo's 0.9 s at T=512 H=2048 V=65536 on a Zen 5)")
    parser.add_argument("--out", default=None, help="also write the result as JSON")
    args = parser.parse_args(argv)
    b, t, h, v = args.shape
    result = measure(b, t, h, v, args.dtype, args.workload, args.rows, args.cols, args.lse_dtype,
                     threads=args.threads, token_block=args.token_block, eager=not args.no_eager)
    print(f"B={b} T={t} H={h} V={v} {args.dtype}, workload {args.workload}, {result['rows']} sampled rows of "
          f"dhidden and {result['cols']} of dW (all {h} columns), LSE reference in {args.lse_dtype}; "
          f"CPU: {result['cpu_model']}")
    print("| gradient | error | grpo | torch eager | reference rounded to the dtype |")
    print("|---|---|---|---|---|")
    for grad, cells in result["errors"].items():
        for metric, label in (("max_abs_rel", "max |err| / max |ref|"), ("rel_l2", "||err|| / ||ref||")):
            eager_cell = f"{cells['eager'][metric]:.3e}" if cells["eager"] is not None else "(not run)"
            print(f"| {grad} | {label} | {cells['grpo'][metric]:.3e} | {eager_cell} | "
                  f"{cells['ref_rounded'][metric]:.3e} |")
    eager_time = f"{result['eager_s']:.1f} s" if "eager_s" in result else "not run"
    print(f"(grpo {result['grpo_s']:.1f} s, eager {eager_time}, reference {result['reference_s']:.1f} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
