"""dtrain.notices: the one channel for what the user is told, rank 0's only."""

from tqdm import tqdm

from dtrain.notices import for_rank, notice


def test_a_notice_is_one_line_on_stderr(capsys):
    notice("engine.compile is off")
    out = capsys.readouterr()
    assert (out.out, out.err) == ("", "engine.compile is off\n")


def test_a_notice_goes_above_a_progress_bar(capsys):
    """With a bar on stderr the line is printed whole, not into the bar's line (tqdm.write)."""
    with tqdm(total=3, file=None, mininterval=0, bar_format="{n_fmt}/{total_fmt}") as bar:
        bar.update(1)
        notice("step 1: non-finite loss or gradient, update skipped")
    lines = capsys.readouterr().err.replace("\r", "\n").splitlines()
    assert "step 1: non-finite loss or gradient, update skipped" in lines


def test_only_rank_0_speaks():
    assert for_rank(True) is notice and for_rank(False) is None
