"""fixtures.data: the SQuAD-shaped dataset, the byte tokenizer, SFT masking, THD packing, CP split.

Oracles are written here independently: the CP split is checked against a reshape of
`arange(L)` into `2*cp` chunks, packing against the examples it was given.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fixtures.data import (
    ByteTokenizer,
    Example,
    cp_partition_index,
    pack_examples,
    padded_length,
    pretrain_example,
    sft_example,
    sft_prompt,
    shard_pack,
    squad_like_dataset,
    tokenize_dataset,
)

pytestmark = pytest.mark.L0

TOK = ByteTokenizer()


def _example(n: int, seed: int) -> Example:
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 256, (n + 1,), generator=g).tolist()
    mask = torch.randint(0, 2, (n + 1,), generator=g).tolist()
    return Example(tuple(toks[:-1]), tuple(toks[1:]), tuple(mask[1:]))


def test_squad_rows_have_the_squad_schema_and_true_answer_spans() -> None:
    ds = squad_like_dataset(num_rows=24, seed=3)
    assert ds.column_names == ["id", "title", "context", "question", "answers"]
    assert len(ds) == 24
    assert len(set(ds["id"])) == 24
    for row in ds:
        (text,), (start,) = row["answers"]["text"], row["answers"]["answer_start"]
        assert row["context"][start : start + len(text)] == text
        assert row["question"].endswith("?")


def test_dataset_is_deterministic_per_seed_and_differs_across_seeds() -> None:
    assert squad_like_dataset(8, seed=1).to_list() == squad_like_dataset(8, seed=1).to_list()
    assert squad_like_dataset(8, seed=1).to_list() != squad_like_dataset(8, seed=2).to_list()


def test_dataset_refuses_an_empty_request() -> None:
    with pytest.raises(ValueError, match="num_rows"):
        squad_like_dataset(0)


@given(st.text(max_size=80))
def test_byte_tokenizer_round_trips_any_text(text: str) -> None:
    ids = TOK.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert TOK.decode([TOK.bos_id, *ids, TOK.eos_id, TOK.pad_id]) == text


def test_padded_vocab_is_a_multiple_that_holds_the_specials() -> None:
    assert TOK.padded_vocab_size(64) == 320
    assert TOK.padded_vocab_size(128) % 128 == 0 and TOK.padded_vocab_size(128) >= TOK.vocab_size


def test_sft_loss_mask_selects_exactly_the_answer_and_eos() -> None:
    for row in squad_like_dataset(12, seed=5):
        ex = sft_example(row, TOK, max_len=255)
        assert len(ex.input_ids) == len(ex.labels) == len(ex.loss_mask)
        assert ex.input_ids[1:] == ex.labels[:-1]  # next-token shift
        masked = [lab for lab, m in zip(ex.labels, ex.loss_mask, strict=True) if m]
        assert masked == [*TOK.encode(row["answers"]["text"][0]), TOK.eos_id]
        # the masked labels are the tail: loss only after the prompt
        first = ex.loss_mask.index(1)
        assert all(ex.loss_mask[first:]) and not any(ex.loss_mask[:first])
        assert TOK.decode(ex.input_ids[: first + 1]).endswith(sft_prompt(row))


def test_sft_truncation_shortens_the_prompt_never_the_answer() -> None:
    row = squad_like_dataset(1, seed=0)[0]
    full = sft_example(row, TOK, max_len=1000)
    short = sft_example(row, TOK, max_len=40)
    assert len(short) == 40 < len(full)
    assert sum(short.loss_mask) == sum(full.loss_mask)
    with pytest.raises(ValueError, match="does not fit"):
        sft_example(row, TOK, max_len=3)


def test_pretrain_example_has_loss_everywhere_and_respects_max_len() -> None:
    row = squad_like_dataset(1, seed=0)[0]
    ex = pretrain_example(row, TOK, max_len=30)
    assert len(ex) == 30 and all(ex.loss_mask)
    assert ex.input_ids[0] == TOK.bos_id
    assert TOK.decode(ex.input_ids) == f"{row['title']}: {row['context']}"[:29]


def test_tokenize_dataset_goes_through_datasets_map() -> None:
    ds = squad_like_dataset(6, seed=2)
    examples = tokenize_dataset(ds, TOK, kind="sft", max_len=255)
    assert examples == [sft_example(r, TOK, 255) for r in ds]
    with pytest.raises(ValueError, match="kind"):
        tokenize_dataset(ds, TOK, kind="rlhf", max_len=255)


@given(
    lengths=st.lists(st.integers(1, 120), min_size=1, max_size=12),
    cp=st.sampled_from([1, 2, 4]),
    pack_len=st.sampled_from([128, 256]),
)
def test_packs_hold_every_example_once_in_order_with_cp_aligned_padding(
    lengths: list[int], cp: int, pack_len: int
) -> None:
    examples = [_example(n, i) for i, n in enumerate(lengths) if padded_length(n, cp) <= pack_len]
    packs = pack_examples(examples, pack_len, cp, pad_id=TOK.pad_id)
    seen = []
    for p in packs:
        assert p.tokens.shape == (pack_len,)
        pad = p.cu_seqlens_padded.tolist()
        real = p.cu_seqlens.tolist()
        assert p.cu_seqlens.dtype == p.cu_seqlens_padded.dtype == torch.int32
        assert pad[0] == real[0] == 0 and pad[-1] == pack_len
        assert all((b - a) % (2 * cp) == 0 for a, b in itertools.pairwise(pad))
        assert p.max_seqlen == max(b - a for a, b in itertools.pairwise(pad))
        for j in range(len(pad) - 1):
            n = real[j + 1] - real[j]
            s = pad[j]
            assert n <= pad[j + 1] - pad[j]
            ex = Example(
                tuple(p.tokens[s : s + n].tolist()),
                tuple(p.labels[s : s + n].tolist()),
                tuple(int(x) for x in p.loss_mask[s : s + n].tolist()),
            )
            seen.append(ex)
            assert not p.loss_mask[s + n : pad[j + 1]].any()  # no loss on padding
            assert p.position_ids[s : pad[j + 1]].tolist() == list(range(pad[j + 1] - s))
    assert seen == examples


def test_packing_rejects_bad_lengths() -> None:
    with pytest.raises(ValueError, match="multiple of 2 \\* cp_size"):
        pack_examples([_example(5, 0)], 250, 2, pad_id=0)
    with pytest.raises(ValueError, match="longer than pack_len"):
        pack_examples([_example(300, 0)], 256, 2, pad_id=0)


def _oracle_split(lengths_padded: list[int], cp: int, rank: int) -> list[int]:
    out, start = [], 0
    for n in lengths_padded:
        chunks = torch.arange(start, start + n).reshape(2 * cp, n // (2 * cp))
        out += chunks[[rank, 2 * cp - 1 - rank]].flatten().tolist()
        start += n
    return out


@given(
    units=st.lists(st.integers(1, 6), min_size=1, max_size=6),
    cp=st.sampled_from([1, 2, 3, 4]),
)
def test_cp_split_is_the_load_balanced_two_chunk_partition(units: list[int], cp: int) -> None:
    lengths = [u * 2 * cp for u in units]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    parts = [cp_partition_index(cu, cp, r).tolist() for r in range(cp)]
    for r in range(cp):
        assert parts[r] == _oracle_split(lengths, cp, r)
    assert sorted(i for part in parts for i in part) == list(range(sum(lengths)))
    # Load balance: every rank holds the same number of tokens and the same causal work
    # (sum of in-sequence positions + 1) over the pack.
    starts = cu[:-1].tolist()
    for r in range(1, cp):
        assert len(parts[r]) == len(parts[0])
        work = [sum(p - max(s for s in starts if s <= p) + 1 for p in part) for part in parts]
        assert work[r] == work[0]


def test_cp_split_rejects_unaligned_sequences_and_bad_ranks() -> None:
    with pytest.raises(ValueError, match="padded sequence 1 has length 6"):
        cp_partition_index(torch.tensor([0, 8, 14]), 2, 0)
    with pytest.raises(ValueError, match="cp_rank = 2"):
        cp_partition_index(torch.tensor([0, 8]), 2, 2)


def test_shard_pack_gives_each_rank_its_half_with_unsplit_boundaries() -> None:
    packs = pack_examples([_example(n, n) for n in (30, 50, 20)], 128, 2, pad_id=TOK.pad_id)
    (p,) = packs
    shards = [shard_pack(p, 2, r) for r in range(2)]
    for r, sh in enumerate(shards):
        idx = torch.tensor(_oracle_split(p.padded_lengths, 2, r))
        assert sh["tokens"].shape == (1, 64)
        assert torch.equal(sh["tokens"][0], p.tokens[idx])
        assert torch.equal(sh["loss_mask"][0], p.loss_mask[idx])
        assert torch.equal(sh["cu_seqlens_padded"], p.cu_seqlens_padded)
    with pytest.raises(ValueError, match="padded for cp_size = 2"):
        shard_pack(p, 4, 0)
