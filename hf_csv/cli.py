"""``hf-csv``: build, push, pull and inspect vocabulary indices; run the benchmarks.

    hf-csv build MODEL --out DIR [--num-clusters C] [--metric euclidean|spherical]
    hf-csv push DIR REPO_ID [--revision BRANCH] [--private]
    hf-csv pull REPO_ID --out DIR [--revision REV]
    hf-csv inspect DIR_OR_REPO [--revision REV]
    hf-csv bench {certify,generate,speculative,kernels} [ARGS...]

Bad input prints one clear line and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

BENCH_SCRIPTS = {"certify": "certify_report.py", "generate": "bench_generate.py",
                 "speculative": "bench_speculative.py", "kernels": "bench_kernels.py"}


class CLIError(Exception):
    """A user error: printed without a traceback, exit status 2."""


def _load_head(model: str, revision: Optional[str]):
    """Only the output embedding (and bias) of a local model dir or Hub repo id."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSpeechSeq2Seq

    try:
        cfg = AutoConfig.from_pretrained(model, revision=revision)
    except (OSError, ValueError) as e:
        raise CLIError(f"cannot load a model config from {model!r}: {e}") from e
    cls = AutoModelForSpeechSeq2Seq if getattr(cfg, "is_encoder_decoder", False) else AutoModelForCausalLM
    m = cls.from_pretrained(model, revision=revision, dtype=torch.float32)
    head = m.get_output_embeddings()
    if head is None:
        raise CLIError(f"{model!r} has no output embeddings (LM head)")
    bias = getattr(head, "bias", None)
    name = getattr(cfg, "_name_or_path", None) or model
    return head.weight.detach(), (bias.detach() if bias is not None else None), name


def cmd_build(a: argparse.Namespace) -> int:
    from .index import VocabIndex

    W, b, name = _load_head(a.model, a.revision)
    t0 = time.perf_counter()
    ix = VocabIndex.build(W, b, num_clusters=a.num_clusters, metric=a.metric, niter=a.niter, seed=a.seed,
                          base_model=a.base_model or (None if Path(a.model).exists() else a.model))
    ix.config.stats["build_seconds"] = round(time.perf_counter() - t0, 1)
    ix.save_pretrained(a.out)
    print(f"built {ix} in {ix.config.stats['build_seconds']} s -> {a.out}")
    return 0


def cmd_push(a: argparse.Namespace) -> int:
    from .index import VocabIndex

    if not Path(a.dir).is_dir():
        raise CLIError(f"{a.dir!r} is not a directory")
    ix = VocabIndex.from_pretrained(a.dir)
    info = ix.push_to_hub(a.repo_id, revision=a.revision, private=a.private, endpoint=a.endpoint)
    print(f"pushed {ix} to {a.repo_id}: {getattr(info, 'commit_url', info)}")
    return 0


def cmd_pull(a: argparse.Namespace) -> int:
    from .hub import download_index
    from .index import VocabIndex

    path = download_index(a.repo_id, revision=a.revision, endpoint=a.endpoint)
    VocabIndex.from_pretrained(path)  # verifies the sha256 before anything is copied
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(path).iterdir():
        shutil.copyfile(f, out / f.name)
    print(f"pulled {a.repo_id}@{a.revision or 'main'} -> {out}")
    return 0


def cmd_inspect(a: argparse.Namespace) -> int:
    from dataclasses import asdict

    from .index import VocabIndex

    ix = VocabIndex.from_pretrained(a.index, revision=a.revision, endpoint=a.endpoint)
    print(json.dumps(asdict(ix.config), indent=2, sort_keys=True))
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    here = Path(__file__).resolve().parents[1] / "scripts"
    script = here / BENCH_SCRIPTS[a.which]
    if not script.is_file():
        raise CLIError(f"benchmark script {script} not found (run from a source checkout of hf_csv)")
    return subprocess.call([sys.executable, str(script), *a.args])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-csv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build a vocabulary index from a model's LM head")
    b.add_argument("model", help="local model directory or Hub repo id")
    b.add_argument("--out", required=True, help="output directory")
    b.add_argument("--num-clusters", type=int, default=None, help="clusters (default ~2*sqrt(V), at most 1024)")
    b.add_argument("--metric", choices=["euclidean", "spherical"], default="euclidean")
    b.add_argument("--niter", type=int, default=10)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--revision", default=None)
    b.add_argument("--base-model", default=None, help="base_model written into the model card")
    b.set_defaults(fn=cmd_build)
    for name, helptext in (("push", "upload an index directory to the Hub"), ("pull", "download an index"),
                           ("inspect", "print an index's parameters and fingerprint")):
        s = sub.add_parser(name, help=helptext)
        if name == "push":
            s.add_argument("dir")
            s.add_argument("repo_id")
            s.add_argument("--private", action="store_true")
        elif name == "pull":
            s.add_argument("repo_id")
            s.add_argument("--out", required=True)
        else:
            s.add_argument("index", help="index directory or Hub repo id")
        s.add_argument("--revision", default=None)
        s.add_argument("--endpoint", default=None, help="Hub endpoint (default: HF_ENDPOINT or huggingface.co)")
        s.set_defaults(fn={"push": cmd_push, "pull": cmd_pull, "inspect": cmd_inspect}[name])
    be = sub.add_parser("bench", help="run a benchmark script (args after the name are forwarded)")
    be.add_argument("which", choices=sorted(BENCH_SCRIPTS))
    be.add_argument("args", nargs=argparse.REMAINDER)
    be.set_defaults(fn=cmd_bench)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from .errors import CSVError

    try:
        return args.fn(args)
    except (CLIError, CSVError, FileNotFoundError) as e:
        print(f"hf-csv {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # huggingface_hub errors: one line, not a traceback
        if type(e).__module__.startswith("huggingface_hub"):
            print(f"hf-csv {args.command}: error: {type(e).__name__}: {str(e).splitlines()[0]}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
