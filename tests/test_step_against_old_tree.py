"""scripts/gpu/step_against_old_tree.py: a model shape bench.py does not know is refused in one line."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "step_against_old_tree", ROOT / "scripts" / "gpu" / "step_against_old_tree.py"
)
script = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = script
_spec.loader.exec_module(script)


@pytest.mark.unit
def test_an_unknown_model_shape_exits_2_naming_the_known_ones(tmp_path, capsys):
    out = tmp_path / "new.json"
    with pytest.raises(SystemExit) as exit_:
        script.main(["--model-shape", "llada-9b", "--out", str(out)])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith("--model-shape 'llada-9b': expected one of 0.5b, 1b, dream-7b, llada-8b")
    assert not out.exists()
