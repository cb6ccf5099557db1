"""Trace one certified decode step through hf_csv's modules (issue 38's call tracer).

Runs ``generate`` on a tiny random Llama with ``sys.setprofile`` and reports, for one decode step (from one
top-level forward of the model to the next: head, logits processors, the token choice):

* ``modules``: the hf_csv / hf_csv_kernels modules that ran code in the step;
* ``hops``: calls from a function of one of those modules into a function of another (a call from transformers
  or torch into hf_csv counts as an entry, not a hop);
* ``call_backs``: hops into a module that is already on the call stack below the caller (control going back up
  into a module it came from).

Usage::

    python scripts/trace_step.py                       # greedy, no processor
    python scripts/trace_step.py --repetition-penalty 1.3
    python scripts/trace_step.py --json out.json --step 3 --show
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

import hf_csv
from hf_csv import CSVConfig


def _tests_conftest():
    """The tests' conftest module, read from its file (the tests' tiny random Llama: one definition)."""
    spec = importlib.util.spec_from_file_location("_hf_csv_tests_conftest",
                                                  Path(__file__).resolve().parents[1] / "tests" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tiny_llama = _tests_conftest().tiny_llama

_OURS = ("hf_csv.", "hf_csv_kernels.")


def _module(frame) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name.startswith(_OURS) or name in ("hf_csv", "hf_csv_kernels") else None


# decorators and context managers between two of our functions (torch.no_grad, contextlib) are not a module
# of the step: look through them to the function that called
_TRANSPARENT = ("torch.", "contextlib", "functools")


def _caller(frame) -> str | None:
    f = frame.f_back
    while f is not None:
        mod = _module(f)
        if mod is not None:
            return mod
        name = f.f_globals.get("__name__", "")
        if not name.startswith(_TRANSPARENT) or name.startswith("torch.nn.modules"):
            return None  # transformers (or a Module call from it) called us: an entry
        f = f.f_back
    return None


def trace(step: int = 3, repetition_penalty: float | None = None, max_new_tokens: int = 6,
          warm_tokens: int = 16) -> dict:
    """Trace decode step ``step`` (0 is the prefill) of a certified greedy call after a first call of ``warm_tokens``
    new tokens (0: trace the first call); returns the report. A head's first rows choose its screen's outlier columns
    (8 rows, :class:`hf_csv.core.bounds.ScreenProvider`), a one-off per head; the steps after it take the settled path."""
    model = hf_csv.enable(tiny_llama(scale=20.0))  # spread logits so the certificate prunes
    ids = torch.randint(3, 256, (1, 7), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, csv_config=CSVConfig())
    if repetition_penalty is not None:
        kw["repetition_penalty"] = repetition_penalty
    if warm_tokens:
        model.generate(ids, **{**kw, "max_new_tokens": warm_tokens})  # the screen is built and settles
        # its columns' re-choice runs in a background thread: wait for it (on a busy machine it can outlast the
        # call), so that the traced step is the settled one whatever the load
        from hf_csv.transformers.heads import find_head, get_certified_head

        ch = get_certified_head(find_head(model)[1], CSVConfig())
        deadline = time.monotonic() + 120
        while not ch.settled() and time.monotonic() < deadline:
            time.sleep(0.01)

    steps: list[list[tuple]] = [[]]
    forwards = [0]

    def pre_hook(*_a, **_k):
        forwards[0] += 1
        steps.append([])

    handle = model.register_forward_pre_hook(pre_hook)
    stack: list[str | None] = []  # module of every Python frame entered since tracing began (None: not ours)

    def prof(frame, event, _arg):
        if event == "call":
            mod = _module(frame)
            caller = _caller(frame)
            if mod is not None and caller is not None and mod != caller:
                # back: the callee's module already runs further down this chain of our own frames
                chain = []
                for m in reversed(stack):
                    if m is None:
                        break
                    chain.append(m)
                back = mod in chain[1:]
                steps[-1].append((caller, mod, frame.f_code.co_name, back))
            elif mod is not None and caller is None:
                steps[-1].append((None, mod, frame.f_code.co_name, False))
            stack.append(mod)
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(prof)
    try:
        out = model.generate(ids, **kw, return_dict_in_generate=True)
    finally:
        sys.setprofile(None)
        handle.remove()
    stats = out.csv_stats
    ev = steps[step + 1] if step + 1 < len(steps) else []
    hops = [(a, b, f) for a, b, f, _ in ev if a is not None]
    mods = sorted({b for _, b, _, _ in ev} | {a for a, _, _, _ in ev if a is not None})
    return {
        "step": step,
        "forwards": forwards[0],
        "tokens": out.sequences.shape[-1] - ids.shape[-1],
        "certified": stats.get("summary"),
        "repetition_penalty": repetition_penalty,
        "warm_tokens": warm_tokens,
        "modules": mods,
        "n_modules": len(mods),
        "entries": [(b, f) for a, b, f, _ in ev if a is None],
        "hops": hops,
        "n_hops": len(hops),
        "call_backs": _call_backs(ev),
    }


def _call_backs(ev: list) -> list:
    """Hops into a module the step already passed through before the caller's module first ran (control going back
    up), or into a module still running below the caller (a cycle on the stack)."""
    first: dict = {}
    for a, b, _, _ in ev:
        for m in (a, b):
            if m is not None and m not in first:
                first[m] = len(first)
    return [(a, b, f) for a, b, f, on_stack in ev if a is not None and (on_stack or first[b] < first[a])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--step", type=int, default=3, help="decode step to report (0 is the prefill)")
    ap.add_argument("--repetition-penalty", type=float, default=None)
    ap.add_argument("--warm-tokens", type=int, default=16,
                    help="new tokens of a first call before the traced one (0: trace a first call)")
    ap.add_argument("--show", action="store_true", help="print every hop")
    ap.add_argument("--json", default=None, help="write the report here")
    a = ap.parse_args()
    r = trace(a.step, a.repetition_penalty, warm_tokens=a.warm_tokens)
    print(f"step {r['step']}: {r['n_modules']} modules, {r['n_hops']} hops, {len(r['call_backs'])} call-backs "
          f"({r['certified']})")
    print("modules:", ", ".join(r["modules"]))
    if a.show:
        for e in r["entries"]:
            print("  enter  ", e)
        for h in r["hops"]:
            print("  hop    ", h)
    for h in r["call_backs"]:
        print("  back   ", h)
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
