"""`python -m accounting flops ...` run as a subprocess: output, --json, exit code 2 on bad arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.L0


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "accounting", *args], capture_output=True, text=True, timeout=120, check=False
    )


def llama3_8b_flops(lengths: list[int], pack_len: int) -> tuple[int, int]:
    """Independent per-token arithmetic for Llama 3 8B (32 layers, h 4096, ffn 14336, 32 heads,
    8 groups, head dim 128, vocab 128256, SwiGLU): model and hardware FLOPs of one pack."""
    h, q, k, ffn, vocab, layers = 4096, 4096, 1024, 14336, 128256, 32
    per_token = 6 * layers * (h * (q + 2 * k) + q * h) + 6 * layers * h * ffn * 3 + 6 * h * vocab
    model = per_token * sum(lengths) + 6 * layers * q * sum(s * s for s in lengths)
    hardware = per_token * pack_len + 6 * layers * q * sum(s * s for s in lengths)
    return model, hardware


def test_text_output_shows_terms_model_and_hardware_flops_and_the_dense_over_report():
    result = run_cli("flops", "--preset", "llama3-8b", "--docs", "4096,2048,1024,1024")
    assert result.returncode == 0, result.stderr
    model, _ = llama3_8b_flops([4096, 2048, 1024, 1024], 8192)
    dense, _ = llama3_8b_flops([8192], 8192)
    out = result.stdout
    assert "4 documents, 8192 real tokens in a pack of 8192" in out
    for term in ("attention_projections", "core_attention", "mlp", "logits"):
        assert term in out
    assert f"model FLOPs (exact): {model}" in out
    assert f"pack_len^2 count: {dense:.4e} (over-reports model FLOPs by {dense / model - 1:+.2%})" in out


def test_json_output_is_one_object_with_exact_integers_and_padding_in_hardware_flops():
    result = run_cli("flops", "--preset", "llama3-8b", "--docs", "1000,3000", "--seq-len", "8192", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    model, hardware = llama3_8b_flops([1000, 3000], 8192)
    assert (data["model_flops"], data["hardware_flops"]) == (model, hardware)
    assert data["tokens"] == 4000 and data["pack_len"] == 8192 and data["num_documents"] == 2
    assert sum(data["terms"].values()) == model
    assert data["dense_pack_flops"] == llama3_8b_flops([8192], 8192)[0]


def test_cu_seqlens_and_seq_len_alone_are_accepted():
    a = json.loads(run_cli("flops", "--preset", "qwen3-30b-a3b", "--cu-seqlens", "0,4096", "--json").stdout)
    b = json.loads(run_cli("flops", "--preset", "qwen3-30b-a3b", "--seq-len", "4096", "--json").stdout)
    assert a["model_flops"] == b["model_flops"]
    # Megatron-Bridge's GBS=1 reference, which does not count the router's GEMM
    assert float(f"{a['model_flops'] - a['terms']['moe_router']:.2e}") == 9.42e13


BAD_ARGUMENTS = [
    (("flops", "--preset", "nope", "--seq-len", "8"), "invalid choice: 'nope'"),
    (("flops", "--preset", "llama3-8b", "--docs", "4,x"), "comma-separated integers"),
    (("flops", "--preset", "llama3-8b", "--docs", "4,0"), "lengths must be positive"),
    (
        ("flops", "--preset", "llama3-8b", "--cu-seqlens", "0,5,3"),
        "cu_seqlens[2] = 3 is smaller than cu_seqlens[1] = 5",
    ),
    (
        ("flops", "--preset", "llama3-8b", "--docs", "8,8", "--seq-len", "10"),
        "more tokens than the pack holds",
    ),
    (("flops", "--preset", "llama3-8b"), "give --docs, --cu-seqlens or --seq-len"),
    (("flops", "--preset", "llama3-8b", "--docs", "4", "--cu-seqlens", "0,4"), "not allowed with argument"),
    (("frobnicate",), "invalid choice"),
    # Out-of-range numbers: one line, never a traceback (int64 overflow used to escape as one).
    (("flops", "--preset", "llama3-8b", "--docs", "4000000000"), "--docs: 4000000000 tokens in one pack"),
    (("flops", "--preset", "llama3-8b", "--docs", "2000000000,2000000000"), "--docs: 4000000000 tokens"),
    (("flops", "--preset", "llama3-8b", "--docs", str(2**63)), "is out of range"),
    (("flops", "--preset", "llama3-8b", "--docs", f"{2**62},{2**62}"), "--docs: the total"),
    (("flops", "--preset", "llama3-8b", "--seq-len", "-3"), "--seq-len -3 is out of range"),
    (("flops", "--preset", "llama3-8b", "--seq-len", "4000000000"), "--seq-len: 4000000000 tokens"),
    (("flops", "--preset", "llama3-8b", "--cu-seqlens", f"0,{2**63}"), "--cu-seqlens 9223372036854775808"),
    (("flops", "--preset", "llama3-8b", "--cu-seqlens", "0,-7"), "--cu-seqlens -7 (entry 1) is out of range"),
    (("flops", "--preset", "llama3-8b", "--docs", "@/nonexistent/lengths.txt"), "cannot read"),
    (("flops", "--preset", "llama3-8b", "--docs", ""), "no document length given"),
    ((), "required"),
]


@pytest.mark.parametrize(("args", "needle"), [BAD_ARGUMENTS[0], BAD_ARGUMENTS[3], BAD_ARGUMENTS[5]])
def test_bad_arguments_exit_2_with_one_line_on_stderr(args, needle):
    result = run_cli(*args)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr


@pytest.mark.parametrize(("args", "needle"), BAD_ARGUMENTS)
def test_every_bad_argument_returns_2_with_one_line_on_stderr_in_process(args, needle, capsys):
    # The same entry point `python -m accounting` calls, without a ~3 s interpreter start per case.
    from accounting.cli import main

    assert main(list(args)) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err


def test_importing_accounting_pulls_in_neither_pytest_nor_fixtures_nor_megatron():
    code = (
        "import sys, accounting, accounting.cli, accounting.presets\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('pytest', 'fixtures', 'megatron', 'hypothesis'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_docs_from_a_file_and_from_stdin_take_lists_past_the_argument_size_limit(tmp_path):
    lengths = [1 + (i * 7919) % 300 for i in range(100_000)]  # ~690 KiB of text: over one argument's 128 KiB
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(f"{d}," if i % 3 else str(d) for i, d in enumerate(lengths)))
    from_file = run_cli("flops", "--preset", "llama3-8b", "--docs", f"@{path}", "--json")
    from_stdin = subprocess.run(
        [sys.executable, "-m", "accounting", "flops", "--preset", "llama3-8b", "--docs", "-", "--json"],
        input=" ".join(map(str, lengths)),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    for result in (from_file, from_stdin):
        assert result.returncode == 0, result.stderr
        data = json.loads(result.stdout)
        assert data["num_documents"] == 100_000 and data["tokens"] == sum(lengths)
        assert data["model_flops"] == llama3_8b_flops(lengths, sum(lengths))[0]


def test_an_empty_pack_is_the_same_from_seq_len_0_and_cu_seqlens_0(capsys):
    from accounting.cli import main

    outputs = []
    for args in (["--seq-len", "0"], ["--cu-seqlens", "0"]):
        assert main(["flops", "--preset", "llama3-8b", "--json", *args]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0] == outputs[1]
    assert (outputs[0]["model_flops"], outputs[0]["tokens"], outputs[0]["num_documents"]) == (0, 0, 0)


def test_a_pack_whose_dense_equivalent_is_past_int64_still_gets_its_exact_count(capsys):
    # The documents' sums fit int64; the dense pack_len² = 1.6e19 does not, yet is exact here.
    from accounting.cli import main

    args = ["flops", "--preset", "llama3-8b", "--docs", "1000,3000", "--seq-len", "4000000000", "--json"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model_flops"] == llama3_8b_flops([1000, 3000], 4 * 10**9)[0]
    assert data["hardware_flops"] == llama3_8b_flops([1000, 3000], 4 * 10**9)[1]
    assert data["dense_pack_flops"] == llama3_8b_flops([4 * 10**9], 4 * 10**9)[0]


# ---- list input is bounded and never echoed -----------------------------------------------------


@pytest.mark.parametrize("text", ["1__0", "1_", "_1", "0x10", "1e3", "\u0663", "+-1", "1" * 41])
def test_every_malformed_number_is_one_line_naming_its_entry(text, capsys):
    """`1__0` passed the old check's digits-and-underscores test and ended in a StopIteration."""
    from accounting.cli import main

    assert main(["flops", "--preset", "llama3-8b", "--docs", f"4,{text}"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert "entry 1 in the argument is not an integer" in err and "Traceback" not in err


def test_an_error_in_a_list_file_names_the_entry_never_the_files_text(tmp_path, capsys):
    from accounting.cli import main

    path = tmp_path / "secret.txt"
    path.write_text("4096,2048\nSECRET-TOKEN-abcdef,1024\n")
    assert main(["flops", "--preset", "llama3-8b", "--docs", f"@{path}"]) == 2
    err = capsys.readouterr().err
    assert "SECRET" not in err and f"entry 2 in {str(path)!r} is not an integer" in err, err


def _cli_in(memory: int, *args: str, **kwargs) -> subprocess.CompletedProcess:
    """`python -m accounting ARGS` under an address-space limit (importing torch takes ~650 MB)."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return subprocess.run(
        [sys.executable, "-m", "accounting", *args],
        preexec_fn=limit, capture_output=True, text=True, timeout=120, check=False, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("source", ["/dev/zero", "fifo", "directory", "oversized"])
def test_a_list_source_that_is_not_a_bounded_regular_file_is_refused_in_bounded_memory(tmp_path, source):
    """`@/dev/zero` grew until the OOM killer; a FIFO nobody writes waited forever."""
    from accounting.cli_input import MAX_LIST_BYTES

    path = {"/dev/zero": Path("/dev/zero"), "fifo": tmp_path / "fifo", "directory": tmp_path}.get(
        source, tmp_path / "big.txt"
    )
    if source == "fifo":
        os.mkfifo(path)
    if source == "oversized":
        with open(path, "wb") as f:
            f.truncate(MAX_LIST_BYTES + 1)  # sparse: no disk used
    result = _cli_in(2 << 30, "flops", "--preset", "llama3-8b", "--docs", f"@{path}")
    assert result.returncode == 2 and result.stdout == "", result.stderr[-2000:]
    says = {"oversized": f"holds more than {MAX_LIST_BYTES} bytes", "directory": "Is a directory"}.get(
        source, "is not a regular file"
    )
    assert result.stderr.count("\n") == 1 and says in result.stderr, result.stderr[-2000:]


def test_stdin_past_the_bound_is_refused_and_at_dash_reads_stdin():
    from accounting.cli_input import MAX_LIST_BYTES

    big = _cli_in(
        2 << 30, "flops", "--preset", "llama3-8b", "--docs", "@-", input="1," * (MAX_LIST_BYTES // 2 + 1)
    )
    assert big.returncode == 2 and f"stdin holds more than {MAX_LIST_BYTES} bytes" in big.stderr, big.stderr[
        -2000:
    ]
    small = subprocess.run(
        [sys.executable, "-m", "accounting", "flops", "--preset", "llama3-8b", "--docs", "@-", "--json"],
        input="4096 2048\n1024,1024", capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert small.returncode == 0, small.stderr
    assert json.loads(small.stdout)["model_flops"] == llama3_8b_flops([4096, 2048, 1024, 1024], 8192)[0]


def test_one_document_and_one_token_read_in_the_singular(capsys):
    from accounting.cli import main

    assert main(["flops", "--preset", "llama3-8b", "--cu-seqlens", "0,1", "--seq-len", "4"]) == 0
    assert "llama3-8b: 1 document, 1 real token in a pack of 4" in capsys.readouterr().out


HF_CONFIG = str(Path(__file__).parent / "data" / "hf_configs" / "llama3-70b.json")
# The command's paths that involve no tensor: a preset, --docs, --cu-seqlens, --seq-len alone, an
# HF config, the memory estimate; and a bad argument (exit 2).
NO_TENSOR = [
    ("flops", "--preset", "llama3-8b", "--docs", "4096,2048,1024,1024"),
    ("flops", "--preset", "llama3-8b", "--cu-seqlens", "0,4096,6144,-1", "--seq-len", "8192", "--json"),
    ("flops", "--preset", "gpt3-175b", "--seq-len", "2048", "--device", "H100", "--precision", "linear=fp8"),
    ("flops", "--hf-config", HF_CONFIG, "--docs", "100,200"),
    ("memory", "--preset", "llama3-8b", "--seq-len", "4096", "--tp", "2", "--json"),
    ("memory", "--hf-config", HF_CONFIG, "--seq-len", "4096"),
    ("flops", "--preset", "llama3-8b", "--cu-seqlens", "0,5,3"),
]


@pytest.mark.parametrize("args", NO_TENSOR, ids=lambda a: " ".join(a[:4]))
def test_the_cli_answers_without_importing_torch_where_no_tensor_is_involved(args):
    # In a fresh interpreter: the command's own entry, then what it loaded. numpy neither (torch's
    # import was most of the 2.3-5.5 s a new user waited for arithmetic; numpy is the next).
    code = (
        "import json, sys\n"
        "from accounting.cli import main\n"
        "code = main(json.loads(sys.argv[1]))\n"
        "print(json.dumps([code, sorted(m for m in ('torch', 'numpy') if m in sys.modules)]), file=sys.stderr)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, json.dumps(list(args))],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    exit_code, loaded = json.loads(result.stderr.strip().splitlines()[-1])
    assert exit_code == (2 if args[-1] == "0,5,3" else 0), result.stdout + result.stderr
    assert loaded == [], result.stderr
    assert result.stdout or exit_code == 2


def test_import_accounting_is_cheap_and_torch_comes_with_the_first_tensor_api():
    code = (
        "import sys\n"
        "import accounting\n"
        "from accounting import ModelShape, training_flops, memory_estimate, IntervalThroughput\n"
        "cheap = 'torch' in sys.modules\n"
        "from accounting import SeqlenStats\n"
        "stats = SeqlenStats.dense(2, 8)\n"
        "print(cheap, 'torch' in sys.modules, int(stats.squared), type(stats.squared).__module__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.stdout.split() == ["False", "True", "128", "torch"], result.stdout + result.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "accounting", "flops", "--preset", "llama3-8b", "--docs", "4096,2048", "--json"],
        ["-m", "megatron_testkit", "--help"],
    ],
)
def test_a_reader_that_went_away_is_no_traceback(argv: list[str]) -> None:
    """`python -m accounting flops ... --json | head -c 400` ended in a BrokenPipeError traceback.
    Here the pipe's read end is closed before the command writes, so every write fails for sure."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, *argv], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120
        )
    finally:
        os.close(write)
    assert done.stderr == "" and done.returncode == 1, done.stderr
