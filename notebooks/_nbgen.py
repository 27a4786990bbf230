"""Builds and executes the generated notebooks (notebooks/make_*.py): cells are plain Python in the generator
scripts; executing one runs its code cells in order in one namespace (no Jupyter needed) and stores what each
printed and every matplotlib figure it left open (PNG) as the cell's outputs, so the committed .ipynb renders
with its results where it is browsed. tests/test_notebooks.py executes the same cells and checks their facts."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os


def build(cells) -> dict:
    """The notebook without outputs (what the tests compare with the committed file, outputs stripped)."""
    def cell(kind, src):
        c = {"cell_type": kind, "metadata": {}, "source": src.splitlines(keepends=True)}
        if kind == "code":
            c.update(execution_count=None, outputs=[])
        return c

    return {"cells": [cell(k, s) for k, s in cells], "metadata": {"kernelspec": {"display_name": "Python 3",
            "language": "python", "name": "python3"}, "language_info": {"name": "python"}},
            "nbformat": 4, "nbformat_minor": 5}


def strip_outputs(nb: dict) -> dict:
    nb = json.loads(json.dumps(nb))
    for c in nb["cells"]:
        if c["cell_type"] == "code":
            c["execution_count"], c["outputs"] = None, []
    return nb


def execute(nb: dict, name: str = "notebook", namespace: dict | None = None) -> dict:
    """Run the code cells of ``nb`` in order; returns the namespace. Outputs (stdout, figures) are written into
    ``nb`` in place."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    namespace = {"__name__": "__notebook__"} if namespace is None else namespace
    count = 0
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        count += 1
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile("".join(cell["source"]), f"{name}[cell {i}]", "exec"), namespace)
        outputs = []
        if buf.getvalue():
            outputs.append({"name": "stdout", "output_type": "stream", "text": buf.getvalue().splitlines(True)})
        for num in plt.get_fignums():
            fig = plt.figure(num)
            png = io.BytesIO()
            fig.savefig(png, format="png", dpi=80, bbox_inches="tight")
            outputs.append({"data": {"image/png": base64.b64encode(png.getvalue()).decode("ascii"),
                                     "text/plain": [f"<Figure {num}>"]},
                            "metadata": {}, "output_type": "display_data"})
        plt.close("all")
        cell["execution_count"], cell["outputs"] = count, outputs
    return namespace


def write(cells, filename: str) -> None:
    """Build, execute (from the repository root, as the tests do) and write notebooks/<filename>."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    nb = build(cells)
    os.chdir(root)
    execute(nb, filename)
    path = os.path.join(root, "notebooks", filename)
    with open(path, "w") as f:
        json.dump(nb, f, indent=1)
        f.write("\n")
    print("wrote", path)
