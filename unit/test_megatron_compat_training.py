"""fixtures.training on one process: config mapping, loss reduction, save-queue patch, a 1-rank Trainer.

The multi-rank behaviour (CP=2, checkpoints across CP sizes, FLOPs, TensorBoard) is proven in
functional/test_cp_pretrain_sft.py; here the harness's own pieces are checked in isolation. The
1-rank Trainer runs on an in-process gloo group that the test creates and destroys.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import accounting
from fixtures.data import ByteTokenizer, pack_examples, squad_like_dataset, tokenize_dataset
from fixtures.training import (
    TRACKER_FILE,
    CheckpointMismatchError,
    DenseBatch,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    Trainer,
    checkpoint_dir,
    in_process_write_queue,
)
from megatron_testkit import skips
from megatron_testkit.megatron_cpu import cpu_shim, destroy_model_parallel

pytestmark = [
    pytest.mark.L0,
    skips.skip_if(torch.cuda.is_available(), "no-cuda", "CPU harness checks (the GPU path is functional)"),
]


def test_transformer_config_maps_the_shape_and_the_test_settings() -> None:
    import torch.nn.functional as F

    m = ModelConfig(
        num_layers=3, hidden_size=96, ffn_hidden_size=160, num_attention_heads=6, num_query_groups=3
    )
    c = m.transformer_config(ParallelConfig(cp=2), made_up_field=1)  # unknown keys are dropped
    assert (c.num_layers, c.hidden_size, c.ffn_hidden_size) == (3, 96, 160)
    assert (c.num_attention_heads, c.num_query_groups, c.kv_channels) == (6, 3, 16)
    assert c.gated_linear_unit and c.activation_func is F.silu
    assert c.context_parallel_size == 2 and c.calculate_per_token_loss
    assert c.hidden_dropout == c.attention_dropout == 0.0
    assert not hasattr(c, "made_up_field")
    gelu = ModelConfig(gated_linear_unit=False, overrides=(("normalization", "LayerNorm"),))
    c2 = gelu.transformer_config(ParallelConfig())
    assert c2.activation_func is F.gelu and c2.normalization == "LayerNorm"


def test_loss_func_returns_the_masked_sum_and_token_count() -> None:
    losses = torch.tensor([[1.0, 2.0, 4.0, 8.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    total, tokens, report = Trainer._loss_func(mask, losses)
    assert total.item() == 5.0 and tokens.item() == 2 and tokens.dtype == torch.int
    assert report["lm loss"].tolist() == [5.0, 2.0]


def test_save_queue_patch_is_scoped_and_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    monkeypatch.setattr(fa, "_results_queue", None)  # as in a process that has not saved yet
    with in_process_write_queue():
        assert isinstance(fa._results_queue, queue.Queue)
    assert fa._results_queue is None
    sentinel = object()  # a queue someone else created (an async save) is left alone
    monkeypatch.setattr(fa, "_results_queue", sentinel)
    with in_process_write_queue():
        assert fa._results_queue is sentinel
    assert fa._results_queue is sentinel


def test_checkpoint_dir_uses_megatron_lm_names(tmp_path: Path) -> None:
    assert checkpoint_dir(tmp_path, 42) == tmp_path / "iter_0000042"


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A 1-rank gloo default group for the test only (the session guard forbids leaks)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        destroy_model_parallel()
        dist.destroy_process_group()


def test_one_rank_trainer_trains_saves_and_refuses_bad_loads(
    one_rank_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.set_num_threads(1)
    tok = ByteTokenizer()
    examples = tokenize_dataset(squad_like_dataset(6), tok, kind="pretrain", max_len=127)
    packs = pack_examples(examples, 128, 1, pad_id=tok.pad_id)
    model = ModelConfig(vocab_size=tok.padded_vocab_size(), max_sequence_length=128)
    seen: list[int] = []
    with cpu_shim():
        trainer = Trainer(
            model, ParallelConfig(), TrainConfig(lr=1e-2, hooks=(lambda t, r: seen.append(r.iteration),))
        )
        with pytest.raises(FileNotFoundError, match=TRACKER_FILE):
            trainer.load(tmp_path / "nothing_here")
        first = trainer.forward_loss(packs[:2])
        result = trainer.train_step(packs[:2])
        assert math.isclose(result.loss, first, rel_tol=1e-6)  # same weights, same batch
        assert result.iteration == 1 and seen == [1] and result.step_flops > 0
        assert result.memory["peak_rss_bytes"] > 0
        # BSHD micro batches go through the same step (dense batch of 2 rows x 64 tokens).
        tokens = torch.randint(0, 256, (2, 64))
        dense = DenseBatch(tokens, torch.roll(tokens, -1, 1), torch.ones(2, 64))
        assert math.isfinite(trainer.forward_loss([dense]))
        saved = trainer.save(tmp_path / "ckpt")
        assert saved == tmp_path / "ckpt" / "iter_0000001"
        assert (tmp_path / "ckpt" / TRACKER_FILE).read_text() == "1"
        trainer.close()
        wide = Trainer(
            ModelConfig(vocab_size=tok.padded_vocab_size() + 64, max_sequence_length=128),
            ParallelConfig(),
            TrainConfig(),
        )
        with pytest.raises(
            CheckpointMismatchError, match=r"'embedding.word_embeddings.weight'.*\(320, 64\).*\(384, 64\)"
        ):
            wide.load(tmp_path / "ckpt")
        again = Trainer(model, ParallelConfig(), TrainConfig(lr=1e-2, log_interval=2))
        assert again.load(tmp_path / "ckpt") == 1
        assert again.iteration == 1 and again.flops.total_flops == trainer.flops.total_flops
        assert math.isclose(again.forward_loss(packs[:2]), trainer.forward_loss(packs[:2]), rel_tol=1e-6)
        # log_interval=2: memory is reduced on even iterations only (2 logs, 3 does not).
        reduced_at: list[int] = []
        real_reduce = accounting.reduce_max_memory

        def counted_reduce(*args, **kwargs):
            reduced_at.append(again.iteration)
            return real_reduce(*args, **kwargs)

        monkeypatch.setattr(accounting, "reduce_max_memory", counted_reduce)
        even, odd = again.train_step(packs[:2]), again.train_step(packs[:2])
        assert (even.iteration, odd.iteration) == (2, 3) and reduced_at == [2]
        assert even.memory["peak_rss_bytes"] > 0 and even.tflops_per_gpu is not None
        assert odd.memory is None and odd.tflops_per_gpu is None and odd.local_memory["peak_rss_bytes"] > 0


def test_probe_returns_each_tokens_cross_entropy_of_the_models_own_logits(one_rank_group: None) -> None:
    import torch.nn.functional as F

    from fixtures.training import thd_packed_seq_params

    torch.set_num_threads(1)
    tok = ByteTokenizer()
    examples = tokenize_dataset(squad_like_dataset(6), tok, kind="pretrain", max_len=127)
    packs = pack_examples(examples, 128, 1, pad_id=tok.pad_id)[:2]
    model = ModelConfig(vocab_size=tok.padded_vocab_size(), max_sequence_length=128)
    with cpu_shim():
        trainer = Trainer(model, ParallelConfig(), TrainConfig())
        probe = trainer.probe(packs)
        loss, grads = trainer.compute_gradients(packs)
        assert probe.loss == loss and probe.grads.keys() == grads.keys()
        assert all(torch.equal(probe.grads[n], g) for n, g in grads.items())
        assert len(probe.tokens) == len(packs)
        for pack, got in zip(packs, probe.tokens, strict=True):
            # The logits of a forward without labels, and torch's cross entropy of them.
            cu, cu_pad = pack.cu_seqlens.to(torch.int32), pack.cu_seqlens_padded.to(torch.int32)
            with torch.no_grad():
                logits = trainer.model[0](
                    input_ids=pack.tokens.unsqueeze(0),
                    position_ids=pack.position_ids.unsqueeze(0),
                    attention_mask=None,
                    packed_seq_params=thd_packed_seq_params(cu, cu_pad, pack.max_seqlen),
                )[0]
            want = F.cross_entropy(logits.float(), pack.labels, reduction="none")
            assert got.loss.shape == pack.tokens.shape and torch.allclose(
                got.loss, want, rtol=1e-5, atol=1e-6
            )
            assert torch.equal(got.loss_mask, pack.loss_mask.float())
            assert torch.allclose(got.logit_abs_max, logits.abs().amax(-1), rtol=1e-5)
            assert (got.logit_abs_sum >= got.logit_abs_max * (1 - 1e-6)).all()
        masked = sum((t.loss * t.loss_mask).sum() for t in probe.tokens)
        count = sum(t.loss_mask.sum() for t in probe.tokens)
        assert math.isclose(float(masked / count), probe.loss, rel_tol=1e-6)
