"""First certified call: building the screen from the head vs loading it from a saved artifact.

    python scripts/artifact_first_call.py --model ~/.cache/hf-csv-models/gemma3-270m [--reps 3] [--threads 2]

"Ready head" = ``get_certified_head`` plus one certified head call on a real hidden state. With hf_csv's native
kernel (``hf_csv_kernels.native``, the default where it builds) there is no prepack; with ``HF_CSV_NATIVE=0`` the
call waits for fbgemm's prepack. Interleaved repetitions, medians; prints JSON with the parts of the artifact
path, which screen kernel ran, and the process's one-time build-or-load time of the native library.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import threading
import time

import torch
from transformers import AutoModelForCausalLM

import hf_csv
from hf_csv import CSVConfig
from hf_csv.hub.artifact import CSVArtifact
from hf_csv.transformers.heads import get_certified_head
from hf_csv_kernels import native
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    native_ok = native.available()  # the library's one-time build (first use on a machine) or load, reported apart
    m = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    head = m.get_output_embeddings()
    seen = []
    hook = head.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
    with torch.no_grad():
        m(input_ids=torch.tensor([[1, 450, 3681, 310, 278, 3303]]))
    hook.remove()
    H = seen[0][0, -1:].float()
    cols = seen[0][0].abs().amax(0).topk(16).indices.sort().values
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        CSVArtifact.build(head.weight, outlier_cols=cols).save_pretrained(tmp)
        build_s = time.perf_counter() - t0
        scratch, art, parts = [], [], []
        for _ in range(a.reps):
            for how in ("scratch", "artifact"):
                hf_csv.refresh(m)
                # as in a fresh process: the previous head's background work (interleaved copy, exact outlier
                # columns, packing) has finished before the clock starts
                for t in threading.enumerate():
                    if t.name.startswith("hf_csv-"):
                        t.join()
                gc.collect()
                cfg = CSVConfig() if how == "scratch" else CSVConfig(index=tmp)
                t0 = time.perf_counter()
                ch = get_certified_head(head, cfg)
                t1 = time.perf_counter()
                ch.topk(H, 1)
                t2 = time.perf_counter()
                (scratch if how == "scratch" else art).append(t2 - t0)
                if how == "artifact":
                    t3 = time.perf_counter()
                    x = CSVArtifact.from_pretrained(tmp)
                    t4 = time.perf_counter()
                    x.screen.rows_for(head.weight)
                    t5 = time.perf_counter()
                    parts.append({"load_and_sha256_s": t4 - t3, "recompute_terms_s": t5 - t4,
                                  "head_ready_s": t1 - t0, "first_head_call_s": t2 - t1})
    med = lambda xs: round(statistics.median(xs), 3)  # noqa: E731
    out = {"model": a.model, "threads": a.threads, "vocab": head.weight.shape[0], "hidden": head.weight.shape[1],
           "artifact_build_s": round(build_s, 2), "first_call_scratch_s": med(scratch),
           "first_call_artifact_s": med(art),
           "artifact_parts_s": {k: med([p[k] for p in parts]) for k in parts[0]}, "reps": a.reps,
           "screen_kernel": "native" if native_ok else "fbgemm", "native_unavailable": native.why_unavailable(),
           "native_library_load_s": round(native.load_seconds or 0.0, 3)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
