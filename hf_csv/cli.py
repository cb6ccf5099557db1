"""``hf-csv``: build, push, pull and inspect artifacts (int8 screen + optional cluster index); publish a
certified ``custom_generate`` model repository; run the benchmarks.

    hf-csv build MODEL --out DIR [--quant int8|fp8] [--index [--num-clusters C] [--metric ...]]
    hf-csv push-model MODEL REPO_ID [--artifact DIR] [--no-weights] [--private]
    hf-csv push DIR REPO_ID [--revision BRANCH] [--private]
    hf-csv pull REPO_ID --out DIR [--revision REV]
    hf-csv inspect DIR_OR_REPO [--revision REV]
    hf-csv bench {certify,generate,speculative,kernels} [ARGS...]

Bad input (a missing or malformed artifact, a wrong path, a Hub error) prints one clear line to stderr and exits
with status 2.
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


def _load_model(model: str, revision: Optional[str]):
    """A local model directory or Hub repo id, loaded in float32 (LM or speech seq2seq)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSpeechSeq2Seq

    try:
        cfg = AutoConfig.from_pretrained(model, revision=revision)
    except (OSError, ValueError) as e:
        raise CLIError(f"cannot load a model config from {model!r}: {e}") from e
    cls = AutoModelForSpeechSeq2Seq if getattr(cfg, "is_encoder_decoder", False) else AutoModelForCausalLM
    return cls.from_pretrained(model, revision=revision, dtype=torch.float32).eval()


def _calibration_cols(m, num_outliers: int):
    """The ``num_outliers`` columns of the head's input with the largest magnitude on a short dummy
    input (the model's massive activations); None when the model cannot be run that way. Any choice is
    sound; a good one keeps the screen tight."""
    import torch

    head = m.get_output_embeddings()
    seen = []
    h = head.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            V = head.weight.shape[0]
            ids = (torch.arange(1, 33) * 7919 % V)[None]
            if getattr(m.config, "is_encoder_decoder", False):
                feats = torch.zeros(1, m.config.num_mel_bins, 2 * m.config.max_source_positions)
                start = m.config.decoder_start_token_id or 0
                m(input_features=feats, decoder_input_ids=torch.full((1, 4), start))
            else:
                m(input_ids=ids)
    except Exception as e:  # an exotic model: leave the choice to the first certified call
        print(f"(calibration skipped: {type(e).__name__}: {e})", file=sys.stderr)
        return None
    finally:
        h.remove()
    H = torch.cat([x.reshape(-1, x.shape[-1]) for x in seen]).float()
    return H.abs().amax(0).topk(min(num_outliers, H.shape[1])).indices.sort().values


def _build_artifact(a: argparse.Namespace):
    from hf_csv.hub.artifact import CSVArtifact

    m = _load_model(a.model, a.revision)
    head = m.get_output_embeddings()
    if head is None:
        raise CLIError(f"{a.model!r} has no output embeddings (LM head)")
    bias = getattr(head, "bias", None)
    t0 = time.perf_counter()
    cols = _calibration_cols(m, a.num_outliers) if a.num_outliers else None
    art = CSVArtifact.build(head.weight.detach(), None if bias is None else bias.detach(), screen=not a.no_screen,
                            quant=a.quant, outlier_cols=cols, index=a.index, num_clusters=a.num_clusters,
                            metric=a.metric, niter=a.niter, seed=a.seed,
                            base_model=a.base_model or (None if Path(a.model).exists() else a.model))
    art.config.stats["build_seconds"] = round(time.perf_counter() - t0, 1)
    return m, art


def cmd_build(a: argparse.Namespace) -> int:
    _, art = _build_artifact(a)
    art.save_pretrained(a.out)
    print(f"built {art} in {art.config.stats['build_seconds']} s -> {a.out}")
    return 0


def cmd_push(a: argparse.Namespace) -> int:
    from hf_csv.hub.artifact import CSVArtifact

    if not Path(a.dir).is_dir():
        raise CLIError(f"{a.dir!r} is not a directory")
    art = CSVArtifact.from_pretrained(a.dir)
    info = art.push_to_hub(a.repo_id, revision=a.revision, private=a.private, endpoint=a.endpoint)
    print(f"pushed {art} to {a.repo_id}: {getattr(info, 'commit_url', info)}")
    return 0


def _model_folder(model: str, revision: Optional[str], endpoint: Optional[str]) -> Path:
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, revision=revision, endpoint=endpoint))


def assemble_model_repo(dest, art, model_dir=None, defaults: Optional[dict] = None) -> Path:
    """Fill ``dest`` with a certified model repository: the model's files (from ``model_dir``), the
    artifact ``art`` with a ``custom_generate`` model card, and the ``custom_generate`` folder whose
    ``CSV_CONFIG_DEFAULTS`` is ``defaults`` (e.g. ``{"index": REPO}``: its own artifact). Without an
    ``index`` default, the method uses an artifact found beside the loaded weights."""
    import re

    from hf_csv.hub import transport as hub
    from hf_csv.hub.vendor import manifest, vendor_into

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if model_dir is not None:
        for f in Path(model_dir).iterdir():
            if f.is_file() and not f.name.startswith(".") and f.name != "README.md":
                shutil.copyfile(f, dest / f.name)
    art.save_pretrained(dest, custom_generate=True)
    cg = dest / "custom_generate"
    hub.copy_folder(hub.custom_generate_folder(), cg)
    vendor_into(cg)  # the folder carries hf_csv itself: nothing to pip install (hf_csv.hub.vendor)
    code = (cg / "generate.py").read_text()
    code, n = re.subn(r"^CSV_CONFIG_DEFAULTS: dict = \{\}$", f"CSV_CONFIG_DEFAULTS: dict = {dict(defaults or {})!r}",
                      code, flags=re.M)
    if n != 1:
        raise CLIError("custom_generate template: the CSV_CONFIG_DEFAULTS line was not found")
    (cg / "generate.py").write_text(code + "\n\n" + manifest())
    return dest


def cmd_push_model(a: argparse.Namespace) -> int:
    """Model files + artifact + custom_generate folder, one commit: ``from_pretrained(REPO,
    trust_remote_code=True).generate(...)`` is then certified decoding."""
    import tempfile

    from hf_csv.hub import transport as hub
    from hf_csv.hub.artifact import CSVArtifact

    if a.artifact:
        art = CSVArtifact.from_pretrained(a.artifact)
    else:
        _, art = _build_artifact(a)
    with tempfile.TemporaryDirectory() as tmp:
        src = None if a.no_weights else _model_folder(a.model, a.revision, a.endpoint)
        assemble_model_repo(tmp, art, src, {} if a.no_default_artifact else {"index": a.repo_id})
        info = hub.upload(tmp, a.repo_id, revision=a.push_revision, private=a.private, endpoint=a.endpoint,
                          commit_message=f"hf_csv: certified custom_generate + artifact ({art.config.fingerprint})")
    print(f"pushed model + {art} + custom_generate to {a.repo_id}: {getattr(info, 'commit_url', info)}")
    return 0


def cmd_pull(a: argparse.Namespace) -> int:
    from hf_csv.hub import transport as hub
    from hf_csv.hub.artifact import ARTIFACT_FILES, CSVArtifact

    path = hub.download(a.repo_id, ARTIFACT_FILES, revision=a.revision, endpoint=a.endpoint)
    CSVArtifact.from_pretrained(path)  # verifies the sha256s before anything is copied
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(path).iterdir():
        shutil.copyfile(f, out / f.name)
    print(f"pulled {a.repo_id}@{a.revision or 'main'} -> {out}")
    return 0


def cmd_inspect(a: argparse.Namespace) -> int:
    from hf_csv.hub.artifact import CSVArtifact

    art = CSVArtifact.from_pretrained(a.index, revision=a.revision, endpoint=a.endpoint)
    print(json.dumps(art.describe(), indent=2, sort_keys=True))
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
    def build_args(b: argparse.ArgumentParser) -> None:
        b.add_argument("model", help="local model directory or Hub repo id")
        b.add_argument("--quant", choices=["int8", "fp8"], default="int8", help="screen codes (default int8)")
        b.add_argument("--num-outliers", type=int, default=16, help="columns of h kept exact, calibrated (0: at "
                       "the first call)")
        b.add_argument("--no-screen", action="store_true", help="leave the screen out")
        b.add_argument("--index", action="store_true", help="also build the paper's FAISS cluster index")
        b.add_argument("--num-clusters", type=int, default=None, help="clusters (default ~2*sqrt(V), at most 1024)")
        b.add_argument("--metric", choices=["euclidean", "spherical"], default="euclidean")
        b.add_argument("--niter", type=int, default=10)
        b.add_argument("--seed", type=int, default=0)
        b.add_argument("--revision", default=None)
        b.add_argument("--base-model", default=None, help="base_model written into the model card")

    b = sub.add_parser("build", help="build an artifact (int8 screen, optionally a cluster index) from a model's head")
    build_args(b)
    b.add_argument("--out", required=True, help="output directory")
    b.set_defaults(fn=cmd_build)
    pm = sub.add_parser("push-model", help="publish model files + artifact + custom_generate into one repository")
    build_args(pm)
    pm.add_argument("repo_id")
    pm.add_argument("--artifact", default=None, help="a built artifact directory (default: build one now)")
    pm.add_argument("--no-weights", action="store_true", help="the repository already holds the model's files")
    pm.add_argument("--no-default-artifact", action="store_true",
                    help="custom_generate does not default to this repository's artifact")
    pm.add_argument("--push-revision", default=None, help="branch to push to (default main)")
    pm.add_argument("--private", action="store_true")
    pm.add_argument("--endpoint", default=None, help="Hub endpoint (default: HF_ENDPOINT or huggingface.co)")
    pm.set_defaults(fn=cmd_push_model)
    for name, helptext in (("push", "upload an artifact directory to the Hub"), ("pull", "download an artifact"),
                           ("inspect", "print what an artifact holds, its sizes and fingerprint")):
        s = sub.add_parser(name, help=helptext)
        if name == "push":
            s.add_argument("dir")
            s.add_argument("repo_id")
            s.add_argument("--private", action="store_true")
        elif name == "pull":
            s.add_argument("repo_id")
            s.add_argument("--out", required=True)
        else:
            s.add_argument("index", help="artifact directory or Hub repo id")
        s.add_argument("--revision", default=None)
        s.add_argument("--endpoint", default=None, help="Hub endpoint (default: HF_ENDPOINT or huggingface.co)")
        s.set_defaults(fn={"push": cmd_push, "pull": cmd_pull, "inspect": cmd_inspect}[name])
    be = sub.add_parser("bench", help="run a benchmark script (args after the name are forwarded)")
    be.add_argument("which", choices=sorted(BENCH_SCRIPTS))
    be.add_argument("args", nargs=argparse.REMAINDER)
    be.set_defaults(fn=cmd_bench)
    return p


def _one_line(text: str) -> str:
    """An error message on one line (a path or a quoted value may hold a newline)."""
    return " ".join(text.split("\n")).strip()


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from hf_csv.core.errors import CSVError

    try:
        return args.fn(args)
    except (CLIError, CSVError, FileNotFoundError) as e:
        print(_one_line(f"hf-csv {args.command}: error: {e}"), file=sys.stderr)
        return 2
    except Exception as e:  # huggingface_hub errors: one line, not a traceback
        if type(e).__module__.startswith("huggingface_hub"):
            print(f"hf-csv {args.command}: error: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
