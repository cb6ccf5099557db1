"""How wide stock's float32 log-normalizer can be, in any summation order (docs/certificates.md §3.6-3.7).

For each decoding row of a real model it prints the number of terms t_k = exp(x_k − max) above u·Z and the
order-free bound on |fl(Z) − Z|/Z that hf_csv uses (hf_csv.core.checks.round_charge), from the exact logits.
This is why token-identical beam search is not certified: the bound accumulates per step in every beam score.

    python scripts/lse_rounding_report.py --model DIR [--whisper]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _rows(model_dir: str, whisper: bool) -> torch.Tensor:
    from _audio import SPEECH

    if whisper:
        from scipy.io import wavfile
        from transformers import AutoModelForSpeechSeq2Seq, AutoProcessor

        proc = AutoProcessor.from_pretrained(model_dir)
        m = AutoModelForSpeechSeq2Seq.from_pretrained(model_dir).eval()
        out = []
        for clip in sorted(SPEECH.glob("en_*.wav"))[:3]:
            sr, a = wavfile.read(clip)
            f = proc(a.astype("float32") / 32768.0, sampling_rate=sr, return_tensors="pt").input_features
            with torch.no_grad():
                ids = m.generate(f, max_new_tokens=60)
                out.append(m(input_features=f, decoder_input_ids=ids).logits[0, 3:])
        return torch.cat(out)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    m = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [json.loads(line)["prompt"] for line in open(SPEECH.parent / "prompts.jsonl")][:3] \
        if (SPEECH.parent / "prompts.jsonl").is_file() else ["The quick brown fox"]
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            g = m.generate(ids, max_new_tokens=40, do_sample=False)
            out.append(m(g).logits[0, ids.shape[1] - 1:])
    return torch.cat(out)


def main() -> None:
    from hf_csv.core.checks import round_charge as _round_charge

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--whisper", action="store_true")
    a = ap.parse_args()
    x = _rows(a.model, a.whisper).double()
    m = x.amax(1, keepdim=True)
    t = torch.exp(x - m)
    z = t.sum(1)
    rel = _round_charge(t, m - x, z) / z
    heavy = (t >= 2.0 ** -24 * z[:, None]).sum(1).double()
    print(json.dumps({"model": a.model, "rows": int(x.shape[0]), "vocab": int(x.shape[1]),
                      "terms_above_uZ_median": float(heavy.median()), "rel_bound_median": float(rel.median()),
                      "rel_bound_max": float(rel.max())}))


if __name__ == "__main__":
    main()
