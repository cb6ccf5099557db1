"""Run by tests/test_stack_vllm_engine.py::test_in_place_weight_reload_rebuilds_the_screen (vLLM's venv): load SRC, generate
once with the plugin (its screen is built from SRC's head), reload NEW's weights in place (vLLM's own
``reload_weights``: the same storage, written through ``.data``), then generate on the same engine with vLLM's head
and with the plugin. Prints one JSON line: the token ids of both and the plugin's row counts."""
import json
import os
import sys

os.environ.update(VLLM_PLUGINS="hf_csv", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_USE_V2_MODEL_RUNNER="0",
                  VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", TOKENIZERS_PARALLELISM="false",
                  HF_HUB_OFFLINE="1", HF_CSV_SPEED_GUARD="0")


def main() -> None:
    from vllm import LLM, SamplingParams

    import hf_csv.vllm as vllm_plugin
    src, new, prompts_file = sys.argv[1:4]
    prompts = [json.loads(line)["prompt"] for line in open(prompts_file)][:4]
    params = [SamplingParams(temperature=0.0, max_tokens=12) for _ in prompts]
    llm = LLM(model=src, dtype="float32", enforce_eager=True, seed=0, max_model_len=512, max_num_seqs=4,
              enable_prefix_caching=False)

    def run(on: bool) -> tuple:
        os.environ["HF_CSV_VLLM"] = "1" if on else "0"
        vllm_plugin.reset_stats()
        res = llm.generate(prompts, params, use_tqdm=False)
        return [list(r.outputs[0].token_ids) for r in res], vllm_plugin.stats()

    before, _ = run(True)
    llm.collective_rpc("reload_weights", kwargs={"weights_path": new})
    stock, _ = run(False)
    plugin, stats = run(True)
    print(json.dumps({"before": before, "stock": stock, "plugin": plugin, "stats": stats}))


if __name__ == "__main__":
    main()
