"""How far token-identical beam search (``CSVConfig(beam_search="exact")``) is from certifying real decodes, with a
head better than any screen: an *oracle* (measurement only, never a certificate).

The script runs ``scripts/beam_report.py`` (same flags) with the beam head replaced by an oracle that computes
stock's full rows and then pretends to know only part of them:

* S = each row's top ``--set-size`` tokens by stock's logit are "computed"; every other token gets the two-sided
  interval [ℓ_i − r_i, ℓ_i + r_i] with r_i = (screen radius)/``--radius-factor`` (the screen's own U_i − est_i;
  a factor of 127 is what an int8 screen of the int8 residual, 16 bits a weight, would give; ``inf``: r = 0);
* the normalizer's interval then uses the tail's lower bounds too (the shipped box uses S alone), and stock's
  float32 summation error is charged in any order (``--rounding any-order``, the shipped charge of
  docs/certificates.md §3.6) or not at all (``--rounding none``: as if stock's rounding were known);
* the rows the bookkeeping reads are stock's own (tail filled with the exact logits), so the representative is
  stock's step.

Everything after the head (the intervals' float slack, their accumulation through the beam scores, the decisions
of docs/certificates.md §3.10) is hf_csv's shipped code. A restart means a decision that even this oracle could not
certify. Prints the beam_report summary and the normalizer interval widths (nats).

    HF_CSV_SPEED_GUARD=0 python scripts/beam_oracle.py --radius-factor inf --rounding none \\
        --model smollm2-135m --num-beams 4 --inputs 4 --pairs 1
"""
from __future__ import annotations

import argparse
import atexit
import math
import runpy
import statistics
import sys
from pathlib import Path

import torch

import hf_csv.core.certificate as cert
import hf_csv.core.checks as checks
import hf_csv.transformers.plans as plan
import hf_csv.transformers.processors as proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set-size", type=int, default=64, help="tokens per row treated as computed (top by logit)")
    ap.add_argument("--radius-factor", type=float, default=math.inf, help="tail radius = screen radius / this")
    ap.add_argument("--rounding", choices=("any-order", "none"), default="any-order")
    args, rest = ap.parse_known_args()
    lower: dict[int, torch.Tensor] = {}
    widths: list[float] = []
    u32 = checks.U32

    def spec(self, H, eps=1e-2, temperature=1.0, out_dtype=None):
        if eps != plan.BEAM_EPS:  # not the beam head: the shipped path
            return orig_spec(self, H, eps, temperature, out_dtype)
        d = out_dtype or torch.float32
        Hf = H.float()
        X = self._stock_rows(Hf, H, d).float()
        est, U = self.provider(Hf)
        r = torch.zeros_like(X) if math.isinf(args.radius_factor) else (U - est).clamp(min=0) / args.radius_factor
        idx = X.topk(min(args.set_size, X.shape[1]), dim=1).indices
        S = torch.zeros_like(X, dtype=torch.bool).scatter_(1, idx, True)
        st = cert.CertStats(vocab_size=self.vocab_size)
        st.rows = st.certified = H.shape[0]
        up = X + r + X.abs() * 1e-6
        lower[up.untyped_storage().data_ptr()] = X - r - X.abs() * 1e-6
        return cert.CertResult(logits=X.to(d), stats=st, mask=S, upper=up)

    def box(sess, input_ids, last, p, stop=None):  # beam_logprob_box with the tail's lower bounds
        S = last.mask[:, p]
        up = last.upper[:, p].double()
        low = lower[last.upper.untyped_storage().data_ptr()].view(last.upper.shape)[:, p].double()
        up = up + up.abs() * 4 * u32
        bound = torch.where(S, torch.full_like(up, -math.inf), up).amax(1)
        x = last.logits[:, p].double()
        neg = torch.full_like(x, -math.inf)
        fin = torch.isfinite(x) & S
        m = torch.where(fin, x, neg).amax(1)
        out = ~S
        t_s = torch.exp(torch.where(fin, x - m[:, None], neg))
        t_o = torch.where(out, torch.exp((up - m[:, None]).clamp(max=700.0)), torch.zeros_like(up))
        l_o = torch.where(out, torch.exp((low - m[:, None]).clamp(max=700.0)), torch.zeros_like(up))
        zs = t_s.sum(1)
        z_lo, z_hi = zs + l_o.sum(1), zs + t_o.sum(1)
        rho = torch.zeros_like(zs)
        if args.rounding == "any-order":
            d_s = torch.where(fin, m[:, None] - x, torch.zeros_like(x))
            d_o = torch.where(out, (m[:, None] - up).clamp(min=0.0), torch.zeros_like(up))
            C = checks.round_charge(t_s, d_s, z_hi) + checks.round_charge(t_o, d_o, z_hi) + 64 * u32 * z_hi
            rho = C / z_lo
        widths.extend((torch.log(z_hi / z_lo) + 2 * rho).tolist())
        lse_lo, lse_hi = m + torch.log(z_lo), m + torch.log(z_hi)
        ok = (rho < 0.5) & torch.isfinite(lse_hi)
        rho = torch.where(ok, rho, torch.zeros_like(rho))
        a = (lse_hi + torch.log1p(rho))[:, None]
        b = (lse_lo + torch.log1p(-rho))[:, None]
        s = 4 * u32 * (x.abs() + lse_hi.abs()[:, None] + 1.0)  # the shipped float slack per token
        lo64 = torch.where(fin, x - a - s, neg)
        hi64 = torch.where(fin, x - b + s, neg)
        ob = bound - b[:, 0] + 4 * u32 * (bound.abs() + lse_hi.abs() + 1.0)
        lo, hi = cert._f32_down(lo64), cert._f32_up(hi64)
        for pr in sess.processors or ():
            if pr is stop:
                break
            if not (isinstance(pr, proc.CSVLogitsProcessor) or getattr(pr, "csv_identity", False)):
                lo, hi = pr(input_ids, lo), pr(input_ids, hi)
        return lo, hi, cert._f32_up(ob)

    orig_spec = cert.CertifiedHead.spec
    cert.CertifiedHead.spec = spec
    plan.beam_logprob_box = box

    @atexit.register
    def _report() -> None:
        if widths:
            w = sorted(widths)
            print(f"normalizer interval width (nats) over {len(w)} rows: median {statistics.median(w):.3g}, "
                  f"p90 {w[int(0.9 * (len(w) - 1))]:.3g}, max {w[-1]:.3g}")

    sys.argv = [str(Path(__file__).with_name("beam_report.py"))] + rest
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
