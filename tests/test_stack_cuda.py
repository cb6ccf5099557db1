"""The certified head and generate on a CUDA device, against stock on the same device (skipped without CUDA).

CI has no GPU: these run when a device is lent (docs/benchmarks.md §4 says when they last ran and where).
They check on cuBLAS and the Triton kernels what the CPU suites check on MKL and fbgemm:

* certified top-k tokens equal stock's ``F.linear`` top-k at real head sizes (fp32, bf16);
* Gumbel draws with given noise equal the argmax of stock's values plus that noise (the deterministic core of
  exact sampling: the law then follows from the noise's law);
* greedy ``generate`` with ``csv_config`` returns stock's tokens on a tiny Llama (fp32, bf16, left padding) and
  certifies rows (speed guard off); with the guard on, the call runs the full head and says why.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

from hf_csv.core.certificate import CertifiedHead  # noqa: E402

SIZES = [(151936, 1536), (262144, 640), (32000, 4096)]


def _head(V: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    W = (torch.randn(V, d, device="cuda", generator=g) * 0.05).to(dtype)
    H = (torch.randn(8, d, device="cuda", generator=g) * 3).to(dtype)
    return W, H


@pytest.mark.parametrize("V,d", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 5])
def test_certified_topk_is_stocks_topk_on_cuda(V, d, dtype, k):
    W, H = _head(V, d, dtype)
    head = CertifiedHead(W)
    stock = F.linear(H, W).float()
    exact_values = head.subset_exact()
    for n in (1, 8):
        r = head.topk(H[:n], k=k, out_dtype=dtype if dtype != torch.float32 else None)
        kth = stock[:n].topk(k, dim=1).values[:, -1:]
        # the certificate: S holds every token at or above stock's k-th value (ties included) ...
        assert r.mask[stock[:n] >= kth].all()
        # ... and every token outside S lies at or below the bound, strictly below the k-th
        out = torch.where(r.mask, torch.full_like(stock[:n], float("-inf")), stock[:n])
        assert (out.amax(1) <= r.bound).all() and (r.bound < kth[:, 0]).all()
        if exact_values:  # cuBLAS computed the column subsets as the full call: the values are stock's
            assert torch.equal(r.logits[r.mask], stock[:n][r.mask])
        assert r.stats.certified > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gumbel_draw_with_given_noise_is_stocks_argmax_on_cuda(dtype):
    V, d, N = 151936, 1536, 64
    W, _ = _head(V, d, dtype, seed=1)
    g = torch.Generator(device="cuda").manual_seed(2)
    H = (torch.randn(N, d, device="cuda", generator=g) * 3).to(dtype)
    head = CertifiedHead(W)
    E = torch.empty(N, V, device="cuda").exponential_(generator=g)
    noise = -E.log()
    for T in (1.0, 0.7):
        r = head.sample(H, temperature=T, out_dtype=dtype if dtype != torch.float32 else None, noise=noise)
        law = F.linear(H, W).float()
        law = law / T if T != 1.0 else law
        assert torch.equal(r.tokens, (law + noise).argmax(1)), T
        assert r.stats.certified > 0


def _tiny_llama(dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(20.0)
    m.generation_config.pad_token_id = 0
    return m.to("cuda", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_generate_identical_on_cuda(dtype, monkeypatch):
    import hf_csv
    from hf_csv import CSVConfig
    monkeypatch.setenv("HF_CSV_SPEED_GUARD", "0")  # exactness, not the speed choice
    m = hf_csv.enable(_tiny_llama(dtype))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 32000, (4, 9), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :3] = 0
    mask[0, :3] = 0
    x = {"input_ids": ids.cuda(), "attention_mask": mask.cuda()}
    a = m.generate(**x, max_new_tokens=24, do_sample=False)
    b = m.generate(**x, max_new_tokens=24, do_sample=False, csv_config=CSVConfig())
    assert torch.equal(a, b)
    st = m.csv_last_stats
    assert st["certified"] > 0, st


def test_speed_guard_runs_the_full_head_on_cuda(monkeypatch):
    import hf_csv
    from hf_csv import CSVConfig
    monkeypatch.delenv("HF_CSV_SPEED_GUARD", raising=False)
    m = hf_csv.enable(_tiny_llama(torch.bfloat16))  # 32000 x 128: a guarded head
    ids = torch.randint(3, 32000, (2, 9), generator=torch.Generator().manual_seed(3)).cuda()
    a = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    b = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, csv_config=CSVConfig())
    assert torch.equal(a, b)
    st = m.csv_last_stats
    assert st["mode"] == "full" and any("CUDA" in r for r in st["reasons"]), st
