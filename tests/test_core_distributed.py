"""Vocabulary-parallel certified head on torch.distributed (gloo, CPU; 2 and 4 ranks via torch.multiprocessing)."""
import pytest
import torch
import torch.multiprocessing as mp

import dist_worker
from conftest import MODELS


def _spawn(world, checks, tmp_path, model_dir=None):
    # the ranks meet through a file store in the test's own directory, not a TCP port picked here and bound later
    # by rank 0 (another process could take the port in between)
    mp.spawn(dist_worker.run, args=(world, str(tmp_path / "store"), str(tmp_path), checks, model_dir), nprocs=world,
             join=True)
    outs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r, o in enumerate(outs):
        assert "error" not in o, f"rank {r}:\n{o['error']}"
    return outs


@pytest.fixture(scope="module", params=[2, 4])
def world_results(request, tmp_path_factory):
    world = request.param
    return world, _spawn(world, ["head", "generate", "tp"], tmp_path_factory.mktemp(f"w{world}"))


@pytest.mark.slow
def test_certified_topk_matches_the_full_head_on_every_rank(world_results):
    world, outs = world_results
    for rank, o in enumerate(outs):
        for key, val in o["head"].items():
            if key[1] == "owners":
                continue
            ok_ids, ok_vals, sparse, sent, full_bytes, fallback = val
            assert ok_ids and ok_vals and sparse, (rank, key)
            # O(k) collectives: far below an all-gather of the logits
            assert sent < full_bytes / 4, (rank, key, sent, full_bytes)
            if key[2] == 1 and key[3] == 3:
                assert fallback > 0, key  # budget of one token < k: every row fell back, still exact


@pytest.mark.slow
def test_top_token_lives_on_every_rank_in_turn(world_results):
    world, outs = world_results
    o = outs[0]["head"]
    for name in ("contiguous", "round_robin", "size_balanced", "round_robin_tokens"):
        assert o[(name, "owners")] == list(range(world)), name
    # one shard empty: every other rank still owned a winner
    assert o[("last_empty", "owners")] == list(range(world - 1))


def test_greedy_generate_identical_to_single_process_stock(world_results):
    world, outs = world_results
    for rank, o in enumerate(outs):
        g = o["generate"]
        for strategy in ("contiguous", "round_robin", "size_balanced"):
            same, certified, mode = g[strategy]
            assert same and certified > 0 and mode == "topk", (rank, strategy, g[strategy])
        assert g["sampling_mode"] == "full"


def test_tensor_parallel_sharded_lm_head_is_used_as_sharded(world_results):
    world, outs = world_results
    for rank, o in enumerate(outs):
        tp_stock_same, csv_same, certified, parallel = o["tp"]
        assert tp_stock_same and csv_same and certified > 0 and parallel, (rank, o["tp"])


@pytest.mark.slow
def test_real_smollm_two_ranks(tmp_path):
    d = MODELS / "smollm2-135m"
    if not (d / "PROVENANCE.json").is_file():
        pytest.skip("smollm2-135m not prepared: python ../shared/models/prepare.py ci")
    outs = _spawn(2, ["smollm"], tmp_path, str(d))
    for rank, o in enumerate(outs):
        same, certified, rows = o["smollm"]
        assert same and certified == rows > 0, (rank, o["smollm"])


@pytest.mark.slow
def test_real_smollm_tp_plan_auto_three_ranks(tmp_path):
    """transformers' own tensor parallelism (tp_plan="auto", gloo): lm_head is sharded by vocabulary and the
    certified head uses those shards. 3 ranks: SmolLM2's 9 query / 3 key-value heads must divide evenly
    (stock TP itself fails on 2 ranks)."""
    d = MODELS / "smollm2-135m"
    if not (d / "PROVENANCE.json").is_file():
        pytest.skip("smollm2-135m not prepared: python ../shared/models/prepare.py ci")
    outs = _spawn(3, ["tp_auto"], tmp_path, str(d))
    for rank, o in enumerate(outs):
        sharded, tp_same, csv_same, certified = o["tp_auto"]
        assert sharded and tp_same and csv_same and certified > 0, (rank, o["tp_auto"])


def test_shard_tokens_partition_and_errors():
    from hf_csv.core.distributed import shard_tokens

    for strategy in ("contiguous", "round_robin", "size_balanced"):
        for W in (1, 2, 3, 7):
            parts = shard_tokens(101, W, strategy)
            assert len(parts) == W
            assert torch.equal(torch.cat(parts).sort().values, torch.arange(101))
    with pytest.raises(ValueError, match="strategy"):
        shard_tokens(10, 2, "random")
    with pytest.raises(ValueError, match="world_size"):
        shard_tokens(10, 0)


def test_vocab_parallel_without_process_group_is_a_clear_error():
    import hf_csv
    from hf_csv import CSVConfig
    from hf_csv.core.errors import CSVError

    m = hf_csv.enable(dist_worker.tiny_llama())
    with pytest.raises(CSVError, match="torch.distributed"):
        m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, csv_config=CSVConfig(vocab_parallel="round_robin"))
    with pytest.raises(ValueError, match="vocab_parallel"):
        CSVConfig(vocab_parallel="diagonal")
