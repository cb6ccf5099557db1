#!/usr/bin/env python
"""Vocabulary-parallel certified head vs the tensor-parallel all-gather of logits, on torch.distributed.

    flock /tmp/hf_csv_bench.lock python scripts/bench_distributed.py --world 2 --json out/dist.json

Every rank loads the same model, takes the final hidden states of real prompts (one decode row per
step), and times two ways of getting the greedy token from a vocabulary-sharded head:

* ``allgather``: what transformers' ``colwise_gather_output`` lm_head does: each rank computes its shard's
  logits, all-gather to [V], argmax;
* ``certified``: :class:`hf_csv.core.distributed.VocabParallelHead` (local screen + exact candidates, O(k)
  collectives).

Reports the median time per step of each, their ratio, and the payload bytes each rank sends per step.
On a 2-core CPU with gloo this is a correctness-and-communication measurement, not a scaling one:
the ranks share two cores. Under torchrun on a GPU node use ``--backend nccl`` (docs/distributed.md).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODELS = pathlib.Path(os.environ.get("HF_CSV_MODELS", "~/.cache/hf-csv-models")).expanduser()
PROMPTS = ROOT.parent / "shared" / "models" / "prompts.jsonl"


@torch.no_grad()
def hidden_states(model_dir: pathlib.Path, n: int) -> tuple[torch.Tensor, torch.nn.Linear]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    Hs = []
    for line in PROMPTS.read_text().splitlines():
        if not line.strip():
            continue
        ids = tok(json.loads(line)["prompt"], return_tensors="pt").input_ids
        Hs.append(m.model(ids).last_hidden_state[0])
        if sum(h.shape[0] for h in Hs) >= n:
            break
    return torch.cat(Hs)[:n], m.lm_head


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group(args.backend, rank=rank, world_size=world)
    from hf_csv.core.distributed import VocabParallelHead, shard_tokens

    H, head = hidden_states(MODELS / args.model, args.steps)
    dev = torch.device("cuda", rank) if args.backend == "nccl" else torch.device("cpu")
    H = H.to(dev)
    W = head.weight.detach().to(dev)
    V = W.shape[0]
    ids = shard_tokens(V, world, "contiguous")[rank].to(dev)
    rows = W[int(ids[0]):int(ids[-1]) + 1]
    vp = VocabParallelHead(rows, ids, V, budget=0.05)
    sizes = [len(s) for s in shard_tokens(V, world, "contiguous")]
    width = max(sizes)

    def allgather_step(h):
        loc = torch.full((1, width), float("-inf"), device=dev)
        loc[:, : rows.shape[0]] = h @ rows.T
        out = [torch.empty_like(loc) for _ in range(world)]
        dist.all_gather(out, loc)
        return int(torch.cat([o[:, :n] for o, n in zip(out, sizes)], 1).argmax())

    def certified_step(h):
        return int(vp.topk(h, 1).logits.argmax())

    for i in range(3):  # warm-up (screen calibration, allocator)
        allgather_step(H[i : i + 1])
        certified_step(H[i : i + 1])
    vp.comm.__init__()
    times = {"allgather": [], "certified": []}
    agree = 0
    for rep in range(args.repeats):
        for i in range(H.shape[0]):
            h = H[i : i + 1]
            for name, fn in (("allgather", allgather_step), ("certified", certified_step)):
                dist.barrier()
                t = time.perf_counter()
                tok = fn(h)
                times[name].append(time.perf_counter() - t)
                if name == "allgather":
                    ref = tok
                else:
                    agree += int(tok == ref)
    c = vp.comm
    steps = args.repeats * H.shape[0]
    res = {
        "rank": rank, "world": world, "backend": args.backend, "model": args.model, "vocab_size": V,
        "hidden_size": W.shape[1], "steps": steps,
        "ms_per_step_allgather": 1e3 * statistics.median(times["allgather"]),
        "ms_per_step_certified": 1e3 * statistics.median(times["certified"]),
        "bytes_per_step_certified": c.bytes_sent / c.steps,
        "bytes_per_step_allgather": width * 4,
        "identical_tokens": agree == steps,
        "fallback_rows": c.fallback_rows,
    }
    res["speedup"] = res["ms_per_step_allgather"] / res["ms_per_step_certified"]
    res["bytes_ratio"] = res["bytes_per_step_certified"] / res["bytes_per_step_allgather"]
    torch.save(res, f"{out_path}.rank{rank}")
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen-coder-0.5b")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64, help="decode rows (hidden states of real prompts)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--json", type=pathlib.Path, required=True)
    args = ap.parse_args(argv)
    if not (MODELS / args.model / "PROVENANCE.json").is_file():
        raise SystemExit(f"{args.model} not prepared: python ../shared/models/prepare.py {args.model}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    mp.spawn(worker, args=(args.world, port, args, str(args.json)), nprocs=args.world, join=True)
    ranks = [torch.load(f"{args.json}.rank{r}", weights_only=False) for r in range(args.world)]
    for r in range(args.world):
        os.remove(f"{args.json}.rank{r}")
    res = {"command": " ".join(["python", *sys.argv]), "torch": torch.__version__, "cpu_count": os.cpu_count(),
           "ranks": ranks}
    for k in ("ms_per_step_allgather", "ms_per_step_certified", "bytes_per_step_certified", "bytes_per_step_allgather"):
        res[k] = max(r[k] for r in ranks)  # the slowest rank / the largest sender sets the pace
    res["speedup"] = res["ms_per_step_allgather"] / res["ms_per_step_certified"]
    res["bytes_ratio"] = res["bytes_per_step_certified"] / res["bytes_per_step_allgather"]
    res["identical_tokens"] = all(r["identical_tokens"] for r in ranks)
    args.json.write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if k != "ranks"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
