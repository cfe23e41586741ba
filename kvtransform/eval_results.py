"""The results table of ``kvtransform eval-sparse`` (:mod:`kvtransform.eval_sparse`): ``results.csv`` merged
across runs (rows keyed by model, document, head, budget and the settings), ``results.md`` (the mean over documents
and the per-document rows) and ``results.png``; each written atomically, an existing table checked whole before
anything is evaluated or merged."""
from __future__ import annotations

from pathlib import Path

from .utils import atomic_write

__all__ = ["RESULT_COLUMNS", "SETTINGS", "read_results", "write_results", "summarize", "markdown"]


#: the columns every kvtransform's results.csv has held: the merge's key and the summary's measurements
RESULT_COLUMNS = ("model", "document", "head", "budget", "recall_mean", "recall_worst", "nll_increase", "agreement",
                  "select_ms")


def read_results(out):
    """The rows of ``out/results.csv`` (a pandas DataFrame) that :func:`write_results` merges with, None where there
    is no such file. The whole file is checked, so that a damaged one is refused before an evaluation, never merged.

    Raises:
        ValueError: one line naming the file and the fix (move it away, or choose another ``out=``): not a regular
            file; not UTF-8 CSV; empty; its last line without a newline or a row with fewer or more fields than the
            header (cut short, as by a run killed while writing it); a column of :data:`RESULT_COLUMNS` missing;
            a column named twice; a row without a value there, or a non-number where a number belongs (the budget
            or a setting of :data:`SETTINGS`: not an integer >= 1).
    """
    import csv
    import io

    import pandas as pd

    path = Path(str(out)).expanduser() / "results.csv"
    if not path.exists():
        return None

    def bad(why: str) -> ValueError:
        return ValueError(f"{path} cannot be merged with this run's rows ({why}): move it away or choose another "
                          f"out=<directory>")

    if not path.is_file():
        raise bad("not a regular file")
    try:
        text = path.read_text(encoding="utf-8")
        rows = list(csv.reader(io.StringIO(text, newline="")))
        if not text.strip() or not text.endswith("\n"):
            raise bad(f"{'empty' if not text.strip() else 'its last line has no newline'}: cut short, as by a run "
                      f"killed while writing it")
        twice = [c for c in rows[0] if rows[0].count(c) > 1]
        if twice:
            raise bad(f"the header names column {twice[0]} twice: edited")
        missing = [c for c in RESULT_COLUMNS if c not in rows[0]]
        if missing:
            raise bad(f"no {', '.join(missing)} column: not eval-sparse results, or cut short")
        for line, row in enumerate(rows[1:], start=2):
            if row and len(row) != len(rows[0]):
                raise bad(f"line {line} has {len(row)} fields, the header {len(rows[0])}: cut short or edited")
            empty = [c for c in RESULT_COLUMNS if row and not row[rows[0].index(c)].strip()]
            if empty:
                raise bad(f"line {line} has no {empty[0]}")
        old = pd.read_csv(io.StringIO(text), keep_default_na=False, na_values=[""])  # ('NA', 'nan': not numbers)
    except (UnicodeDecodeError, csv.Error, pd.errors.ParserError) as e:
        raise bad(f"not a UTF-8 CSV file: {str(e).strip().splitlines()[0]}") from None
    for c in RESULT_COLUMNS[3:]:
        if len(old) and not pd.api.types.is_numeric_dtype(old[c]):
            raise bad(f"column {c} holds a value that is not a number")
    for c in ("budget",) + tuple(c for c in SETTINGS if c in old.columns):  # settings may be empty (older runs)
        v = old[c].dropna()
        if len(v) and (pd.api.types.is_bool_dtype(v) or not pd.api.types.is_numeric_dtype(v)
                       or not bool(((v == v.round()) & (v >= 1) & (v < 2 ** 62)).all())):   # (inf, 1e30: no int64)
            raise bad(f"column {c} holds a value that is not an integer >= 1")
    return old


def write_results(df, out) -> None:
    """Merge ``df`` into ``out/results.csv`` (replacing rows of equal model, document, head, budget and settings:
    ``cached`` prompt tokens, ``continuation``, ``generate``; a row without settings, from an older kvtransform, by a
    new row of its model, document, head and budget), then write ``results.md`` (mean over documents per
    head, budget and settings, plus the per-document rows) and ``results.png``. ``seconds``: the head's evaluation
    on one document (the dense teacher pass, shared by every head of a document, is not in it). Each file is
    written atomically (:func:`kvtransform.utils.atomic_write`): a run killed meanwhile leaves the earlier one.

    Raises:
        ValueError: an existing ``results.csv`` that cannot be merged (:func:`read_results`; nothing written).
    """
    import pandas as pd

    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    csv = out / "results.csv"
    old = read_results(out)
    settings = [c for c in SETTINGS if c in df.columns or (old is not None and c in old.columns)]
    labels = [c for c in LABELS if c in df.columns or (old is not None and c in old.columns)]
    key = ["model", "document", "head", "budget"] + settings + labels
    if old is not None:
        # a row written without its settings (an older kvtransform) is superseded by a new row of the same model,
        # document, head and budget: its settings are unknown, so no other row can ever be its duplicate; likewise
        # a row without the labels by a new row of the same settings
        base = ["model", "document", "head", "budget"]
        unset = old[[c for c in settings if c in old.columns]].isna().all(axis=1) if settings else old["model"].isna()
        ours = old[base].apply(tuple, axis=1).isin(set(df[base].apply(tuple, axis=1)))
        known = [c for c in settings if c in old.columns and c in df.columns]
        unlabelled = old[[c for c in labels if c in old.columns]].isna().all(axis=1) if labels else unset
        same = old[base + known].astype(str).apply(tuple, axis=1).isin(
            set(df[base + known].astype(str).apply(tuple, axis=1)))
        df = pd.concat([old[~(unset & ours) & ~(unlabelled & same)], df])
    for c in settings:   # integers; rows written without a setting (older runs) keep it empty, never 1024.0000
        df[c] = df[c].astype("Int64") if c in df.columns else pd.array([pd.NA] * len(df), dtype="Int64")
    df = df.drop_duplicates(subset=key, keep="last").sort_values(key).reset_index(drop=True)
    with atomic_write(csv) as tmp:
        df.to_csv(tmp, index=False)
    summary = summarize(df)
    with atomic_write(out / "results.md") as tmp:
        tmp.write_text("## Mean over documents\n\n" + markdown(summary) + "\n\n## Per document\n\n"
                       + markdown(df) + "\n")
    with atomic_write(out / "results.png") as tmp:
        _plot(summary, tmp)


def markdown(df) -> str:
    """A pandas DataFrame as a GitHub markdown table (floats with 4 decimals; no ``tabulate`` dependency)."""
    def cell(v):
        if type(v).__name__ == "NAType" or (isinstance(v, float) and v != v):
            return ""                                     # a setting an older run did not record
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


SETTINGS = ("cached", "continuation", "generate")  # rows measured with other settings are never averaged together
#: the other settings that name a row (never averaged together either): ``num_sink``, the head's weights
#: (``retrieval``: a trained head's directory, ``self`` for the packaged one, ``-`` for heads that read none) and the
#: model's dtype; rows of older runs lack them (empty)
LABELS = ("num_sink", "retrieval", "dtype")


def summarize(df):
    """Mean over documents per (model, head, budget, settings): recall mean/worst layer, NLL increase, agreement.
    Rows of earlier runs with other settings (``cached`` prompt tokens, ``continuation``, ``generate``) stay
    separate rows."""
    cols = ["recall_mean", "recall_worst", "nll_increase", "agreement", "select_ms"]
    by = ["model", "head", "budget"] + [c for c in SETTINGS + LABELS if c in df.columns]
    g = df.groupby(by, as_index=False, dropna=False)
    s = g[cols].mean()
    s.insert(len(by), "documents", g.size()["size"].values)
    return s


def _plot(summary, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    settings = [c for c in SETTINGS if c in summary.columns]
    several = len(summary.drop_duplicates(settings)) > 1 if settings else False
    for key, g in summary.groupby(["head"] + settings, dropna=False):
        label = key[0] if not several else f"{key[0]} ({'/'.join(str(v) for v in key[1:])})"  # prefix/cont./gen.
        g = g.sort_values("budget")
        axes[0].plot(g.budget, g.recall_mean, marker="o", label=label)
        axes[1].plot(g.budget, g.nll_increase, marker="o", label=label)
        axes[2].plot(g.budget, g.agreement, marker="o", label=label)
    for ax, title in zip(axes, ["recall (mean over layers)", "NLL increase (nats/token)", "greedy agreement"]):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (tokens per KV head)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
