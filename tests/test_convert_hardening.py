"""The converter under bad destinations, write failures, signals and damaged output.

Every case: the exit status, exactly one stderr line with the expected words, no traceback,
and the output's parent folder exactly as before (names, kinds and sizes, recursively).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import python_module_from_a_terminal, tiny_config

import convert.conversion
import convert.hf_to_jax
import dllm_jax.models.checkpoint.hf_reader
from convert.conversion import convert_checkpoint
from convert.hf_to_jax import main
from convert.jax_to_hf import save_hf_checkpoint
from dllm_jax.models.checkpoint.converted import METADATA_FILE, PARAMS_DIR
from dllm_jax.models.checkpoint.errors import ConversionError
from dllm_jax.models.loading import load_model
from dllm_jax.models.transformer import abstract_params
from dllm_jax.runtime.memory_estimate import DeviceMemory

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, tiny_tokenizer_dir):
    """A small LLaDA checkpoint (about 5 MB in two shards): big enough that the phases of a
    conversion last long enough to be seen from outside."""
    cfg = tiny_config(
        d_model=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        mlp_hidden_size=256,
        vocab_size=2048,
        mask_token_id=2046,
        eos_token_id=2047,
        pad_token_id=2047,
        bos_token_id=2045,
    )
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda leaf: (rng.standard_normal(leaf.shape) * 0.02).astype(np.float32), abstract_params(cfg)
    )
    return save_hf_checkpoint(
        tmp_path_factory.mktemp("hf") / "hf", cfg, params, max_shard_bytes=3_000_000, tokenizer_dir=tiny_tokenizer_dir
    )


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    return convert_checkpoint(hf_dir, tmp_path_factory.mktemp("converted") / "out", dtype="float32")


def listing(folder: Path) -> list[tuple[str, str, int]]:
    """Every entry under ``folder``: relative path, kind and size (0 for folders)."""
    entries = []
    for path in sorted(folder.rglob("*")):
        kind = "link" if path.is_symlink() else "dir" if path.is_dir() else "file"
        entries.append((str(path.relative_to(folder)), kind, path.lstat().st_size if kind == "file" else 0))
    return entries


def run_main(argv, capsys):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line(err, *words):
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and ".tmp-" not in err, err
    for word in words:
        assert word in lines[0], err


# ---------------------------------------------------------------------------------------------
# --out: checked before anything is read


def _existing_folder(base):
    (base / "out").mkdir()
    (base / "out" / "keep.txt").write_text("mine")
    return base / "out", "output folder already exists"


def _existing_file(base):
    (base / "out").write_text("mine")
    return base / "out", "exists and is not a folder"


def _symlink(base):
    (base / "target").mkdir()
    (base / "out").symlink_to(base / "target")
    return base / "out", "symbolic link"


def _broken_symlink(base):
    (base / "out").symlink_to(base / "nowhere")
    return base / "out", "symbolic link"


def _missing_parent(base):
    return base / "absent" / "out", "does not exist"


def _under_a_file(base):
    (base / "file").write_text("x")
    return base / "file" / "out", "is not a folder"


def _empty(base):
    return "", "path is empty"


def _blank(base):
    return "  ", "path is empty"


def _root(base):
    return "/", "not a new folder name"


def _unwritable_filesystem(base):
    return "/proc/dllm-jax-out", "cannot create the output folder"


def _name_too_long(base):
    # the name itself fits; its temporary sibling ".NAME.tmp-XXXXXXXX" does not
    return base / ("n" * 250), "File name too long"


BAD_OUTS = [
    _existing_folder,
    _existing_file,
    _symlink,
    _broken_symlink,
    _missing_parent,
    _under_a_file,
    _empty,
    _blank,
    _root,
    _unwritable_filesystem,
    _name_too_long,
]


@pytest.mark.parametrize("make", BAD_OUTS, ids=lambda f: f.__name__.strip("_"))
def test_a_bad_out_exits_2_before_any_shard_is_read(hf_dir, tmp_path, capsys, monkeypatch, make):
    base = tmp_path / "base"
    base.mkdir()
    out, words = make(base)
    before = listing(base)
    started = []
    monkeypatch.setattr(convert.hf_to_jax, "_run_conversion_process", lambda *a, **k: started.append(a))
    code, _, err = run_main(["--hf-dir", hf_dir, "--out", out], capsys)
    assert code == 2
    assert_one_line(err, "error: ", str(out) if str(out).strip() else "", words)
    assert not started
    assert listing(base) == before


@pytest.mark.parametrize("make", BAD_OUTS, ids=lambda f: f.__name__.strip("_"))
def test_the_library_checks_out_before_any_shard_is_read(hf_dir, tmp_path, monkeypatch, make):
    base = tmp_path / "base"
    base.mkdir()
    out, words = make(base)
    before = listing(base)
    opened = []
    monkeypatch.setattr(dllm_jax.models.checkpoint.hf_reader, "safe_open", lambda *a, **k: opened.append(a))
    with pytest.raises(ConversionError, match=words):
        convert_checkpoint(hf_dir, out, dtype="float32")
    assert not opened
    assert listing(base) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_parent_is_refused(hf_dir, tmp_path, capsys):
    base = tmp_path / "ro"
    base.mkdir()
    base.chmod(0o555)
    try:
        code, _, err = run_main(["--hf-dir", hf_dir, "--out", base / "out"], capsys)
    finally:
        base.chmod(0o755)
    assert code == 2
    assert_one_line(err, "not writable")


def test_relative_out_and_an_existing_empty_folder_work(hf_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(["--hf-dir", hf_dir, "--out", "tiny-jax", "--dtype", "float32"], capsys)
    assert (code, err) == (0, "") and out.startswith("wrote tiny-jax: 39 tensors, float32, ")
    assert load_model("tiny-jax", dtype="float32").config.n_layers == 4
    (tmp_path / "empty").mkdir()
    assert convert_checkpoint(hf_dir, "empty", dtype="float32") == tmp_path / "empty"
    assert (tmp_path / "empty" / METADATA_FILE).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "tiny-jax"]


# ---------------------------------------------------------------------------------------------
# Write errors name --out


def test_too_little_free_space_is_found_before_reading(hf_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        convert.conversion.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 10**6)
    )
    opened = []
    monkeypatch.setattr(dllm_jax.models.checkpoint.hf_reader, "safe_open", lambda *a, **k: opened.append(a))
    with pytest.raises(
        ConversionError, match=r"^out: the converted params need 0.0\d GB, its file system has 0.00 GB free"
    ):
        convert_checkpoint(hf_dir, "out", dtype="float32")
    assert not opened and list(tmp_path.iterdir()) == []


def test_too_little_host_memory_is_found_before_reading(hf_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(convert.conversion, "host_memory", lambda: DeviceMemory(available=10**6, name="host RAM"))
    opened = []
    monkeypatch.setattr(dllm_jax.models.checkpoint.hf_reader, "safe_open", lambda *a, **k: opened.append(a))
    with pytest.raises(
        ConversionError,
        match=rf"^{hf_dir}: converting to float32 needs about 0.0\d GB of memory, "
        r"host RAM has 0.00 GB available$",
    ):
        convert_checkpoint(hf_dir, tmp_path / "out", dtype="float32")
    assert not opened and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "error",
    [
        OSError(28, "No space left on device"),
        ValueError('Error writing local file "{tmp}/params/d/x": DATA_LOSS'),
        PermissionError(13, "Permission denied"),
    ],
    ids=["disk full", "tensorstore", "permission"],
)
def test_write_errors_name_out_never_the_temporary_folder(hf_dir, tmp_path, monkeypatch, error):
    def failing_save(path, params):
        path.mkdir()
        (path / "partial").write_text("half written")
        if isinstance(error, ValueError):
            raise ValueError(str(error).replace("{tmp}", str(path.parent)))
        raise error

    monkeypatch.setattr(convert.conversion, "save_params", failing_save)
    with pytest.raises(ConversionError) as raised:
        convert_checkpoint(hf_dir, tmp_path / "out", dtype="float32")
    message = str(raised.value)
    assert message.startswith(f"{tmp_path / 'out'}: cannot write the checkpoint (")
    assert ".tmp-" not in message and "\n" not in message
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Signals: the temporary output never survives


def _tmp_folders(parent):
    return [p for p in parent.iterdir() if p.name.startswith(".out.tmp-")]


def _phase_reached(parent, phase):
    """Whether the conversion writing into ``parent`` has reached ``phase``."""
    tmps = _tmp_folders(parent)
    if not tmps:
        return False
    if phase == "started":
        return True
    params = list(tmps[0].glob(f"{PARAMS_DIR}*"))
    if phase == "saving":
        return bool(params)
    if phase == "writing data":  # TensorStore has written array chunks
        return any(p.is_file() for folder in params for p in folder.rglob("d/*"))
    raise ValueError(phase)


def _conversion_children(parent):
    """PIDs of conversion processes writing into ``parent`` that are still alive."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "convert.conversion" in cmdline and str(parent) in cmdline:
            pids.append(int(proc.name))
    return pids


# every point with two signals and every signal at two points (each case is a process that
# imports jax and converts); "+1s" is 1 s after the temporary folder appeared (the child
# importing jax or reading shards), "saving" once orbax created its folder, "writing data"
# once TensorStore wrote array chunks
SIGNAL_CASES = [
    (signal.SIGINT, "started", 0.0),
    (signal.SIGHUP, "started", 0.0),
    (signal.SIGTERM, "started", 1.0),
    (signal.SIGHUP, "started", 1.0),
    (signal.SIGINT, "saving", 0.0),
    (signal.SIGTERM, "saving", 0.0),
    (signal.SIGTERM, "writing data", 0.0),
    (signal.SIGINT, "writing data", 0.0),
]


@pytest.mark.integration
@pytest.mark.parametrize(
    "signum,phase,delay", SIGNAL_CASES, ids=[f"{s.name}-{p}{'+1s' if d else ''}" for s, p, d in SIGNAL_CASES]
)
def test_a_signal_at_any_phase_leaves_the_parent_as_before(hf_dir, tmp_path, signum, phase, delay):
    parent = tmp_path / "parent"
    parent.mkdir()
    (parent / "unrelated.txt").write_text("keep")
    before = listing(parent)
    # its own session, so the signal goes to its process group as a terminal's Ctrl-C or hang-up does
    process = subprocess.Popen(
        [
            *python_module_from_a_terminal("convert.hf_to_jax"),
            "--hf-dir",
            str(hf_dir),
            "--out",
            str(parent / "out"),
            "--dtype",
            "float32",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not _phase_reached(parent, phase):
            assert process.poll() is None, f"the conversion ended before {phase}: {process.communicate()}"
            assert time.monotonic() < deadline, f"{phase} not reached in 120 s"
            time.sleep(0.002)
        # a later point of the same phase, but never past the save: on an idle machine the small
        # conversion can finish within the delay
        later = time.monotonic() + delay
        while time.monotonic() < later and not _phase_reached(parent, "saving"):
            time.sleep(0.002)
        os.killpg(process.pid, signum)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 128 + signum, err
    assert out == ""
    assert err == f"interrupted by {signum.name}: nothing was written to {parent / 'out'}\n"
    assert not _conversion_children(parent)
    assert listing(parent) == before
    time.sleep(0.5)  # nothing is written late either
    assert listing(parent) == before


# ---------------------------------------------------------------------------------------------
# A damaged converted checkpoint: one line


def _remove_process_data(out):
    shutil.rmtree(next((out / PARAMS_DIR).glob("ocdbt.process_*")))


def _truncate_data(out):
    for chunk in (out / PARAMS_DIR).rglob("d/*"):
        chunk.write_bytes(chunk.read_bytes()[:100])


def _garbage_data(out):
    for chunk in (out / PARAMS_DIR).rglob("d/*"):
        chunk.write_bytes(os.urandom(chunk.stat().st_size))


def _empty_manifest(out):
    (out / PARAMS_DIR / "manifest.ocdbt").write_bytes(b"")


def _garbage_metadata(out):
    (out / PARAMS_DIR / "_METADATA").write_text("garbage")


def _wrong_shapes(out):
    metadata = json.loads((out / METADATA_FILE).read_text())
    metadata["hf_config"]["mlp_hidden_size"] = 512
    (out / METADATA_FILE).write_text(json.dumps(metadata))


DAMAGES = [_remove_process_data, _truncate_data, _garbage_data, _empty_manifest, _garbage_metadata, _wrong_shapes]


@pytest.fixture
def damaged(converted, tmp_path, request):
    out = Path(shutil.copytree(converted, tmp_path / "damaged"))
    request.param(out)
    return out


@pytest.mark.parametrize("damaged", DAMAGES, indirect=True, ids=lambda f: f.__name__.strip("_"))
def test_loading_a_damaged_checkpoint_prints_nothing_and_raises_one_line(damaged, capfd):
    with pytest.raises(ConversionError) as raised:
        load_model(damaged, dtype="float32")
    message = str(raised.value)
    assert message.startswith(f"{damaged / PARAMS_DIR}: cannot restore the params (")
    assert "\n" not in message and len(message) < 500
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == ""


@pytest.mark.integration
@pytest.mark.parametrize("damage", [_remove_process_data, _garbage_data], ids=lambda f: f.__name__.strip("_"))
def test_generate_on_a_damaged_checkpoint_prints_one_line(converted, tmp_path, damage):
    out = Path(shutil.copytree(converted, tmp_path / "damaged"))
    damage(out)
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate.py"), "--model", str(out), "--prompt", "x", "--no-progress"],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    assert result.returncode == 2
    # the command's own progress log ("INFO dllm_jax.cli...: loading ...") aside, one line
    own_log = [line for line in result.stderr.splitlines() if line.startswith("INFO dllm_jax.")]
    assert len(own_log) <= 1, result.stderr
    assert_one_line(
        "".join(line + "\n" for line in result.stderr.splitlines() if line not in own_log),
        f"error: {out / PARAMS_DIR}: cannot restore the params",
    )
    assert "asyncio" not in result.stderr
