"""Worker run on every rank by tests/test_core_distributed.py (gloo, CPU). Writes its findings to a file.

Each check compares against the single-process reference computed *inside the same worker* with the
full weights (every rank builds identical models from the same seed).
"""
from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist


def tiny_llama(seed=0, V=700, scale=6.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, pad_token_id=0, eos_token_id=None, tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(scale)
    return m


def _index(W):
    from hf_csv.core.index import VocabIndex

    return VocabIndex.build(W, num_clusters=24, seed=0, niter=5, progress=False)


def check_head(rank, world, out):
    from hf_csv.core.distributed import VocabParallelHead, shard_tokens

    g = torch.Generator().manual_seed(0)
    V, d = 1000, 32
    W = torch.randn(V, d, generator=g)
    b = torch.randn(V, generator=g) * 0.1
    index = _index(W)
    layouts = {s: shard_tokens(V, world, s, index if s != "contiguous" else None)
               for s in ("contiguous", "round_robin", "size_balanced")}
    layouts["round_robin_tokens"] = shard_tokens(V, world, "round_robin", None)
    # uneven (sizes in proportion 1 : 2 : ... : W-1) with the last rank empty
    n = max(1, world - 1)
    w = torch.arange(1, n + 1, dtype=torch.float64)
    cut = [0] + [int(V * float(w[: j + 1].sum() / w.sum())) for j in range(n)]
    layouts["last_empty"] = [torch.arange(cut[r], cut[r + 1]) for r in range(n)] + [torch.arange(0)] * (world - n)
    res = {}
    for name, shards in layouts.items():
        ids = shards[rank]
        for bias in (None, b):
            for budget in (0.05, 1):  # budget=1 token: every row falls back to the full shards
                head = VocabParallelHead(W[ids], ids, V, bias_rows=None if bias is None else bias[ids], budget=budget)
                # hidden states aimed at a token of each rank in turn, plus random ones
                H = [W[shards[r][len(shards[r]) // 2]] * 3 for r in range(world) if len(shards[r])]
                H = torch.stack(H + [torch.randn(d, generator=torch.Generator().manual_seed(5))])
                ref = H @ W.T + (0 if bias is None else bias)
                for k in (1, 3):
                    r = head.topk(H, k)
                    rv, ri = ref.topk(k, dim=1)
                    got_v, got_i = r.logits.topk(k, dim=1)
                    ok_ids = torch.equal(got_i.sort(1).values, ri.sort(1).values)
                    ok_vals = torch.allclose(got_v, rv, atol=1e-4, rtol=1e-5)
                    finite = int(torch.isfinite(r.logits).sum())
                    res[(name, bias is not None, budget, k)] = (ok_ids, ok_vals, finite == k * H.shape[0],
                                                               head.comm.bytes_sent, head.comm.full_logits_bytes,
                                                               r.stats.fallback)
            # which ranks owned the global top-1 of some row (each non-empty rank should, by construction)
            top = ref.argmax(1)
            res[(name, "owners")] = sorted({j for i in range(H.shape[0]) for j, s in enumerate(shards)
                                            if (s == int(top[i])).any()})
    out["head"] = res


def check_generate(rank, world, out):
    import hf_csv
    from hf_csv import CSVConfig
    m = hf_csv.enable(tiny_llama())
    ids = torch.tensor([[5, 17, 33, 2, 9, 44], [7, 7, 8, 100, 3, 1]])
    ref = m.generate(ids, max_new_tokens=20, do_sample=False)
    res = {}
    for strategy in ("contiguous", "round_robin", "size_balanced"):
        o = m.generate(ids, max_new_tokens=20, do_sample=False, csv_config=CSVConfig(vocab_parallel=strategy),
                       return_dict_in_generate=True)
        st = o.csv_stats
        res[strategy] = (torch.equal(o.sequences, ref), st.get("certified", 0), st["mode"])
    # sampling is not certified by the parallel head: full head, with a reason
    o = m.generate(ids, max_new_tokens=3, do_sample=True, csv_config=CSVConfig(vocab_parallel="round_robin"),
                   return_dict_in_generate=True)
    res["sampling_mode"] = o.csv_stats["mode"]
    out["generate"] = res


def check_tensor_parallel(rank, world, out):
    """lm_head sharded by transformers' own 'colwise_gather_output' style (a DTensor Shard(0) weight)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    import hf_csv
    from hf_csv import CSVConfig
    from hf_csv.core.distributed import VocabParallelHead

    m = tiny_llama(V=701)  # not a multiple of the world size: uneven shards
    ids = torch.tensor([[5, 17, 33, 2, 9, 44]])
    ref = m.generate(ids, max_new_tokens=16, do_sample=False)
    mesh = init_device_mesh("cpu", (world,))
    lm = m.lm_head
    lm.weight = torch.nn.Parameter(distribute_tensor(lm.weight.detach(), mesh, [Shard(0)]), requires_grad=False)
    ALL_PARALLEL_STYLES["colwise_gather_output"].install_forward(lm, mesh)
    hf_csv.enable(m)
    with torch.no_grad():
        tp_stock = m.generate(ids, max_new_tokens=16, do_sample=False)
        o = m.generate(ids, max_new_tokens=16, do_sample=False, csv_config=CSVConfig(), return_dict_in_generate=True)
    from hf_csv.transformers.heads import _HEADS

    kinds = [type(e.head).__name__ for per in _HEADS.values() for e in per.values()]
    out["tp"] = (torch.equal(tp_stock, ref), torch.equal(o.sequences, ref), o.csv_stats.get("certified", 0),
                 VocabParallelHead.__name__ in kinds)


def check_smollm(rank, world, out, model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_csv
    from hf_csv import CSVConfig
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    m = hf_csv.enable(AutoModelForCausalLM.from_pretrained(model_dir).eval())
    x = tok(["def fibonacci(n):", "The capital of France is"], return_tensors="pt", padding=True)
    ref = m.generate(**x, max_new_tokens=16, do_sample=False, pad_token_id=tok.eos_token_id)
    o = m.generate(**x, max_new_tokens=16, do_sample=False, pad_token_id=tok.eos_token_id,
                   csv_config=CSVConfig(vocab_parallel="round_robin"), return_dict_in_generate=True)
    out["smollm"] = (torch.equal(o.sequences, ref), o.csv_stats.get("certified", 0), o.csv_stats.get("rows", 0))


def check_tp_auto(rank, world, out, model_dir):
    """Real SmolLM2 loaded by transformers with tp_plan="auto" (gloo on CPU): lm_head sharded by vocabulary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_csv
    from hf_csv import CSVConfig
    from hf_csv.core.distributed import local_shard_of

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    x = tok(["def fibonacci(n):"], return_tensors="pt")
    single = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ref = single.generate(**x, max_new_tokens=16, do_sample=False, pad_token_id=tok.eos_token_id)
    del single
    m = hf_csv.enable(AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto").eval())
    sharded = local_shard_of(m.lm_head.weight) is not None
    with torch.no_grad():
        tp = m.generate(**x, max_new_tokens=16, do_sample=False, pad_token_id=tok.eos_token_id)
        o = m.generate(**x, max_new_tokens=16, do_sample=False, pad_token_id=tok.eos_token_id,
                       csv_config=CSVConfig(), return_dict_in_generate=True)
    out["tp_auto"] = (sharded, torch.equal(tp, ref), torch.equal(o.sequences, tp), o.csv_stats.get("certified", 0))


def run(rank: int, world: int, store: str, outdir: str, checks: list, model_dir: str | None) -> None:
    # what torchrun sets (transformers' tp_plan="auto" reads them; the group itself meets through the file ``store``)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    out = {}
    try:
        for c in checks:
            if c == "head":
                check_head(rank, world, out)
            elif c == "generate":
                check_generate(rank, world, out)
            elif c == "tp":
                check_tensor_parallel(rank, world, out)
            elif c == "smollm":
                check_smollm(rank, world, out, model_dir)
            elif c == "tp_auto":
                check_tp_auto(rank, world, out, model_dir)
    except Exception:  # reported by the parent test
        out["error"] = traceback.format_exc()
    finally:
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
        dist.destroy_process_group()
