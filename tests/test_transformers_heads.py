"""hf_csv.transformers.heads: the head swap acts only in the calling context (other threads get stock's head) and keeps
its wrapper off the model; a head hf_csv cannot certify (a wrapper, a quantized or hooked Linear, an offloaded weight)
runs stock's head with the reason, never raises; the per-weight cache keeps other modules' state off the certified
head."""
from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
from torch import nn
from transformers import LogitsProcessor, LogitsProcessorList

import hf_csv
from hf_csv import CSVConfig
from conftest import _ids, tiny_llama


def test_other_threads_see_the_stock_head(llama):
    """While a certified call runs, another thread calling the (swapped) head gets stock logits."""
    seen = {}
    h = torch.randn(1, 64)

    class Probe(LogitsProcessor):
        csv_kind = "order"

        def __call__(self, ids, s):
            if "diff" not in seen:
                wrapper = llama.lm_head
                t = threading.Thread(target=lambda: seen.setdefault("other", wrapper(h)))
                t.start(), t.join()
                seen["swapped"] = wrapper is not wrapper_inner()
                seen["diff"] = True
            return s

    def wrapper_inner():
        from hf_csv.transformers.heads import find_head
        return find_head(llama)[1]

    stock = wrapper_inner()(h)
    llama.generate(**_ids(), max_new_tokens=2, logits_processor=LogitsProcessorList([Probe()]),
                   csv_config=CSVConfig())
    assert seen["swapped"]
    assert torch.equal(seen["other"], stock)


# ------------------------------------------------------------------ heads hf_csv cannot certify: stock's head, a reason
def _quantize_dynamic(m):
    with warnings.catch_warnings():  # (torch warns that its quantized tensor type is deprecated)
        warnings.simplefilter("ignore")
        torch.ao.quantization.quantize_dynamic(m, {nn.Linear}, dtype=torch.qint8, inplace=True)
    return m


def _declined_like_stock(m, owner=None, what="", n=6, **kw):
    """Greedy and seeded sampling with csv_config on ``m`` (enabled): stock's tokens, a declined call ("full") whose
    reason names ``what``. ``owner``: the model whose csv_last_stats the call writes (peft: the base model)."""
    owner = m if owner is None else owner
    x = _ids()
    for sample in (False, True):
        args = dict(x, max_new_tokens=n, do_sample=sample, **kw)
        torch.manual_seed(7)
        ref = m.generate(**args)
        torch.manual_seed(7)
        out = m.generate(**args, csv_config=CSVConfig())
        assert torch.equal(out, ref)
        st = owner.csv_last_stats
        assert st["mode"] == "full" and st["certified"] == 0, st
        assert what in st["reasons"][0], st["reasons"]
    return st


def _certified_like_stock(m, n=6):
    x = _ids()
    ref = m.generate(**x, max_new_tokens=n, do_sample=False)
    out = m.generate(**x, max_new_tokens=n, do_sample=False, csv_config=CSVConfig())
    assert torch.equal(out, ref)
    assert m.csv_last_stats["mode"] == "topk" and m.csv_last_stats["certified"] > 0, m.csv_last_stats


@pytest.mark.parametrize("order", ["enable_first", "quantize_first"])
def test_a_dynamically_quantized_model_runs_stocks_head(order):
    """quantize_dynamic on the whole model (its head becomes a quantized Linear): enable and the certified call raised
    CSVError ("lm_head is a Linear, not nn.Linear"); now both succeed, the call is stock's, with the reason."""
    m = tiny_llama(scale=20.0)
    if order == "enable_first":
        hf_csv.enable(m)
        _quantize_dynamic(m)
    else:
        hf_csv.enable(_quantize_dynamic(m))
    _declined_like_stock(m, what="quantized")
    assert type(m.lm_head).__module__.startswith("torch.ao")  # restored after the call


def test_a_hooked_or_subclassed_head_runs_stocks_head():
    """A forward hook, a pre-hook, a forward set on the instance or an nn.Linear subclass may change the head's
    output: declined (the hooks and overrides run, as in stock); removed, the head certifies again."""
    m = hf_csv.enable(tiny_llama(scale=20.0))
    bump = torch.zeros(256)
    bump[77] = 1e4

    h = m.lm_head.register_forward_hook(lambda mod, i, o: o + bump)
    st = _declined_like_stock(m, what="forward hooks")
    h.remove()
    h = m.lm_head.register_forward_pre_hook(lambda mod, i: (i[0] * -1.0,))
    _declined_like_stock(m, what="forward hooks")
    h.remove()
    lin = m.lm_head
    lin.forward = lambda x: nn.Linear.forward(lin, x) + bump
    _declined_like_stock(m, what="a forward set on the instance")
    del lin.forward

    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2.0 + bump

    sub = Scaled(64, 256, bias=False)
    sub.weight = lin.weight
    m.lm_head = sub
    _declined_like_stock(m, what="Scaled, not nn.Linear")
    m.lm_head = lin
    _certified_like_stock(m)
    assert st["reasons"][0].startswith("lm_head has forward hooks")


def test_an_offloaded_head_runs_stocks_head():
    """accelerate's cpu_offload: every weight on the meta device, moved in by hooks at forward time."""
    from accelerate import cpu_offload

    m = tiny_llama(scale=20.0)
    cpu_offload(m, execution_device=torch.device("cpu"))
    assert m.lm_head.weight.device.type == "meta"
    _declined_like_stock(hf_csv.enable(m), what="offloaded")


def test_the_rule():
    """head_decline_reason: None for exactly a plain float nn.Linear, a reason for everything else."""
    from hf_csv.transformers.heads import head_decline_reason

    lin = nn.Linear(8, 16)
    assert head_decline_reason(lin) is None and head_decline_reason(lin.half()) is None
    assert "float64" in head_decline_reason(nn.Linear(8, 16).double())
    assert "not nn.Linear" in head_decline_reason(nn.Identity())
    with torch.device("meta"):
        assert "offloaded" in head_decline_reason(nn.Linear(8, 16))

    class Sub(torch.Tensor):
        pass

    odd = nn.Linear(8, 16)
    odd.weight = nn.Parameter(odd.weight.detach().as_subclass(Sub))
    assert "Sub (a tensor subclass" in head_decline_reason(odd)


def _lora(m, r=4):
    from peft import LoraConfig, get_peft_model

    # init_lora_weights=False: a random B, so that the adapter changes the head's output
    return get_peft_model(m, LoraConfig(task_type="CAUSAL_LM", target_modules=["lm_head"], r=r, lora_alpha=8,
                                        init_lora_weights=False))


def test_a_peft_lora_head_runs_stocks_head_until_merged_and_unloaded():
    """peft LoRA on lm_head: unmerged (W x + b + s B A x) and merged in place (merge_adapter: peft's wrapper stays)
    are declined with the reason, stock's tokens (the adapter's, not the base model's); merge_and_unload gives a
    plain nn.Linear, certified again. enable(peft_model) enables its base model (peft's generate calls it)."""
    pytest.importorskip("peft")
    base = tiny_llama(scale=20.0)
    plain = base.generate(**_ids(), max_new_tokens=6, do_sample=False)
    pm = hf_csv.enable(_lora(base))
    inner = pm.get_base_model()
    assert type(inner.lm_head).__name__ == "Linear" and hasattr(inner.lm_head, "base_layer")
    _declined_like_stock(pm, owner=inner, what="peft LoRA Linear (an unmerged adapter")
    assert not torch.equal(pm.generate(**_ids(), max_new_tokens=6, do_sample=False), plain)  # the adapter acts
    pm.merge_adapter()
    _declined_like_stock(pm, owner=inner, what="merged adapter")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = pm.merge_and_unload()
    assert type(m.lm_head) is nn.Linear
    _certified_like_stock(m)


def test_a_torchao_quantized_head_runs_stocks_head():
    """torchao's quantize_ (int8 weight-only) leaves an nn.Linear whose weight is a tensor subclass that reports
    float32: not screened as if plain floats; declined with the reason."""
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    m = tiny_llama(scale=20.0)
    quantize_(m, Int8WeightOnlyConfig(), filter_fn=lambda mod, fqn: fqn == "lm_head")
    assert type(m.lm_head) is nn.Linear and type(m.lm_head.weight) not in (torch.Tensor, nn.Parameter)
    _declined_like_stock(hf_csv.enable(m), what="tensor subclass")


@pytest.mark.parametrize("wrap", ["quantize_dynamic", "lora"])
def test_an_assistant_with_a_wrapped_head_drafts_with_stocks_head(wrap):
    """Assisted decoding whose assistant's head is a quantized Linear or a peft LoRA layer: the draft head stays
    stock's (the target's call still certifies), with the reason, and the tokens are stock's assisted ones."""
    target = hf_csv.enable(tiny_llama(scale=20.0))
    draft = copy.deepcopy(target)
    hf_csv.disable(draft)
    if wrap == "lora":
        pytest.importorskip("peft")
        draft = _lora(draft).get_base_model()
    else:
        _quantize_dynamic(draft)
    x = _ids(batch=1)
    ref = target.generate(**x, max_new_tokens=8, do_sample=False, assistant_model=draft)
    out = target.generate(**x, max_new_tokens=8, do_sample=False, assistant_model=draft, csv_config=CSVConfig())
    assert torch.equal(out, ref)
    st = target.csv_last_stats
    assert any(r.startswith("draft head stays stock: lm_head is") for r in st["reasons"]), st["reasons"]


def test_the_kept_wrapper_stays_off_the_model_and_disable_drops_it():
    """The swapped head is reused by later calls (a compiled graph guards on its identity) but kept beside the model,
    not in it: after a call the model's __dict__, modules and state_dict are as before; disable forgets the wrapper."""
    from hf_csv.transformers import heads
    from hf_csv.transformers.step import CSVHead

    m = hf_csv.enable(tiny_llama(scale=20.0))
    keys, attrs = list(m.state_dict()), set(m.__dict__) | {"csv_last_stats"}
    seen = []

    class Probe(LogitsProcessor):
        csv_kind = "order"

        def __call__(self, ids, s):
            seen.append(m.lm_head)
            return s

    for _ in range(2):
        m.generate(**_ids(), max_new_tokens=2, logits_processor=LogitsProcessorList([Probe()]), csv_config=CSVConfig())
    assert isinstance(seen[0], CSVHead) and all(h is seen[0] for h in seen)
    assert type(m.lm_head) is nn.Linear and list(m.state_dict()) == keys and set(m.__dict__) == attrs
    hf_csv.disable(m)
    assert m not in heads._KEPT


def test_the_cached_head_gets_no_attributes_from_other_modules(monkeypatch):
    """Per-weight state other modules keep (the speed guard, compiled static heads, the weights' key) lives in the
    cache entry (hf_csv.transformers.heads.HeadEntry), not on the CertifiedHead: after certified calls the head holds
    only what its own methods set (the same attributes as after calling them directly)."""
    import hf_csv.core.speed as speed
    from hf_csv.transformers.heads import find_head, head_entry

    monkeypatch.setattr(speed, "MIN_WEIGHTS", 0)  # (a guard for the tiny head)
    m = hf_csv.enable(tiny_llama(scale=20.0))
    x = {"input_ids": torch.tensor([[1, 5, 9, 3]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    for kw in (dict(do_sample=False), dict(do_sample=False, repetition_penalty=1.3), dict(do_sample=True, top_k=5)):
        m.generate(**x, max_new_tokens=5, pad_token_id=0, csv_config=CSVConfig(), **kw)
    entry = head_entry(find_head(m)[1], CSVConfig())
    assert entry.guard is not None and entry.guard._state, "the speed guard was not used"
    ch = entry.head
    fresh = type(ch)(m.lm_head.weight if not hasattr(m.lm_head, "inner") else m.lm_head.inner.weight)
    fresh.topk(torch.randn(2, ch.weight.shape[1]), 3)
    fresh.sample(torch.randn(2, ch.weight.shape[1]))
    extra = set(vars(ch)) - set(vars(fresh))
    assert not extra, f"attributes on the cached certified head that its own calls do not set: {sorted(extra)}"


def test_weight_probe_sees_a_one_element_write_in_every_sampled_row():
    """The fingerprint is exact integer arithmetic: one changed element (the smallest step: one ulp) in any sampled
    row changes it, for every float dtype, within PROBE_ROWS / PROBE_PER_CALL calls."""
    from hf_csv.transformers.heads import PROBE_PER_CALL, PROBE_ROWS, WeightProbe

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        head = torch.nn.Linear(64, 3000, bias=True).to(dtype)
        probe = WeightProbe.of(head)
        calls = -(-len(probe.rows) // PROBE_PER_CALL)
        assert calls <= PROBE_ROWS // PROBE_PER_CALL
        assert all(probe.unchanged(head) for _ in range(calls))
        for k in (0, len(probe.rows) // 2, len(probe.rows) - 1):
            r = int(probe.rows[k])
            with torch.no_grad():
                w = head.weight.data
                w[r, 13] = torch.nextafter(w[r, 13], torch.tensor(float("inf"), dtype=dtype))
            assert not all(probe.unchanged(head) for _ in range(calls)), (dtype, k)
            fresh = WeightProbe.of(head)  # (a rebuilt screen fingerprints the new bytes)
            assert all(fresh.unchanged(head) for _ in range(calls))
            probe = fresh
        head.bias.data[int(probe.rows[3])] += 1
        assert not all(probe.unchanged(head) for _ in range(calls))
