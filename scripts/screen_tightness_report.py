"""How tight the CPU screen is on real hidden states: mean radius and candidate-set sizes for top-k certificates.

For each setting (outlier columns Ŵ[:, J] as before or W[:, J] exact, k columns, chosen from the first n rows)
it reports, over the head inputs of greedy ``generate`` calls on code prompts (the prompt's last position and
each decode step): the mean radius U − est and, for k ∈ {1, 20, 50}, the mean and p90 of
|{i : U_i ≥ the row's k-th largest real logit}|, the set a top-k certificate must recompute at least.
Counts, not timings: the machine's load does not change them.

    python scripts/screen_tightness_report.py --model ~/.cache/hf-csv-models/smollm2-135m --json OUT
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from hf_csv.core.bounds import ScreenProvider  # noqa: E402
from hf_csv_kernels.screen import make_outliers  # noqa: E402


def head_inputs(model_dir: str, prompts: int, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "models", "prompts.jsonl")
    texts = [json.loads(line)["prompt"] for line in open(os.environ.get("HF_CSV_PROMPTS", path))][:prompts]
    seen = []
    head = model.get_output_embeddings()
    hook = head.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, a[0].shape[-1]).detach()))
    try:
        with torch.no_grad():
            for t in texts:
                model.generate(**tok(t, return_tensors="pt"), max_new_tokens=new_tokens, do_sample=False)
    finally:
        hook.remove()
    return torch.cat(seen).float(), head.weight.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--num-outliers", default="16", help="comma-separated k values")
    ap.add_argument("--calib-rows", default="1,8", help="comma-separated: choose the columns from the first n rows")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    H, W = head_inputs(a.model, a.prompts, a.new_tokens)
    ell = H.double() @ W.double().T
    kth = {k: ell.topk(k, dim=1).values[:, -1:] for k in (1, 20, 50)}
    out = {"model": os.path.basename(a.model.rstrip("/")), "rows": H.shape[0], "settings": []}
    for k in [int(x) for x in a.num_outliers.split(",")]:
        for n in [int(x) for x in a.calib_rows.split(",")]:
            for exact in (False, True):
                prov = ScreenProvider(W, num_outliers=k)
                prov.calibrate(H[:n])
                if not exact:
                    prov.state.outliers = make_outliers(prov.rows, prov.state.outlier_cols)  # Ŵ[:, J]
                est, U = prov(H)
                row = {"num_outliers": k, "calib_rows": n, "exact_outlier_columns": exact,
                       "mean_radius": float((U - est).mean())}
                for kk, lo in kth.items():
                    s = (U.double() >= lo).sum(1).double()
                    row[f"top{kk}_set_mean"] = float(s.mean())
                    row[f"top{kk}_set_p90"] = float(s.quantile(0.9))
                out["settings"].append(row)
                print(json.dumps(row), flush=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
