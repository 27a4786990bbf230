"""The notebooks run: every code cell of notebooks/*.ipynb executed in order in one namespace (no Jupyter needed),
and each .ipynb is what its generator script writes."""

import glob
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, capsys):
    with open(path) as f:
        nb = json.load(f)
    namespace = {"__name__": "__notebook__"}
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{os.path.basename(path)}[cell {i}]", "exec"), namespace)
    out = capsys.readouterr().out
    if os.path.basename(path) == "quickstart.ipynb":
        assert "nats/byte" in out and "layer 5:" in out
        losses = [float(line.split("loss ")[1]) for line in out.splitlines() if " loss " in line]
        assert len(losses) == 5 and losses[-1] < losses[0]  # fine-tuning on one snippet lowers its loss


def test_notebooks_match_their_generators(tmp_path):
    for gen in glob.glob(os.path.join(ROOT, "notebooks", "make_*.py")):
        name = os.path.basename(gen)[len("make_"):-3] + ".ipynb"
        committed = open(os.path.join(ROOT, "notebooks", name)).read()
        proc = subprocess.run([sys.executable, "-c", f"import runpy, json; m = runpy.run_path({gen!r}); "
                               "print(json.dumps(m['build'](), indent=1))"], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == json.loads(committed), f"regenerate notebooks/{name}: python {gen}"
