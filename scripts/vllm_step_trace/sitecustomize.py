"""Per-step timings inside a vLLM engine process, for ``scripts/bench_vllm.py --serve`` (not part of hf_csv).

``bench_vllm.py`` puts this directory first on the servers' ``PYTHONPATH`` with ``HF_CSV_STEP_TRACE`` set to a folder;
Python imports ``sitecustomize`` at start-up in every process the server spawns. A daemon thread waits until vLLM's
model runner and ``LogitsProcessor`` are imported (and, with the plugin, its layer class registered), then wraps
``GPUModelRunner.execute_model`` (the CPU runner inherits it) and the heads' ``forward``. Per engine step it appends
one JSON line to ``<folder>/<VLLM_PLUGINS>_<pid>.jsonl``: ``t`` (``time.monotonic()`` at the step's start, the clock
the benchmark reads), ``step`` (seconds in ``execute_model``), ``rows`` (the head's rows, −1 where no head ran),
``head`` (seconds in the layer's ``forward``: the plugin's, or vLLM's own on the stock server) and ``vhead`` (seconds
in vLLM's own head within it). Lines are written 20 steps at a time, so the server's own work between steps is
unchanged but for one small write per 20 steps on both sides. Stock and plugin servers run the same wrappers.
"""
import json
import os
import sys
import threading
import time

_DIR = os.environ.get("HF_CSV_STEP_TRACE")

if _DIR:
    _recs: list = []
    _tl = threading.local()

    def _flush() -> None:
        path = os.path.join(_DIR, f"{os.environ.get('VLLM_PLUGINS', 'default')}_{os.getpid()}.jsonl")
        lines, _recs[:] = [json.dumps(r) for r in _recs], []
        with open(path, "a") as f:
            f.write("".join(x + "\n" for x in lines))

    def _wrap_step(cls) -> None:
        inner = cls.execute_model

        def execute_model(self, scheduler_output, *args, **kwargs):
            _tl.cur = cur = {"t": time.monotonic(), "rows": -1, "head": 0.0, "vhead": 0.0}
            t0 = time.perf_counter()
            try:
                return inner(self, scheduler_output, *args, **kwargs)
            finally:
                cur["step"] = time.perf_counter() - t0
                _tl.cur = None
                _recs.append(cur)
                if len(_recs) >= 20:
                    _flush()

        cls.execute_model = execute_model

    def _wrap_head(cls, *fields: str) -> None:
        inner = cls.forward

        def forward(self, lm_head, hidden_states, *args, **kwargs):
            cur = getattr(_tl, "cur", None)
            t0 = time.perf_counter()
            try:
                return inner(self, lm_head, hidden_states, *args, **kwargs)
            finally:
                if cur is not None:
                    dt = time.perf_counter() - t0
                    for field in fields:
                        cur[field] += dt
                    if "head" in fields:
                        cur["rows"] = int(hidden_states.shape[0])

        cls.forward = forward

    def _install() -> None:
        done: set = set()
        stock = os.environ.get("VLLM_PLUGINS") == "none"
        while len(done) < 3:
            runner = sys.modules.get("vllm.v1.worker.gpu_model_runner")
            if "step" not in done and runner is not None and hasattr(runner, "GPUModelRunner"):
                _wrap_step(runner.GPUModelRunner)
                done.add("step")
            lp = sys.modules.get("vllm.model_executor.layers.logits_processor")
            if "vhead" not in done and lp is not None and hasattr(lp, "LogitsProcessor"):
                # on the stock server vLLM's own forward is the layer's: counted as "head" and "vhead"
                _wrap_head(lp.LogitsProcessor, *(("head", "vhead") if stock else ("vhead",)))
                done.update(("vhead", "head") if stock else ("vhead",))
            op = sys.modules.get("vllm.model_executor.custom_op")
            oot = getattr(op, "op_registry_oot", {}) if op is not None else {}
            if "head" not in done and "LogitsProcessor" in oot:
                _wrap_head(oot["LogitsProcessor"], "head")
                done.add("head")
            time.sleep(0.02)

    threading.Thread(target=_install, name="hf_csv-step-trace", daemon=True).start()
    import atexit

    atexit.register(_flush)
