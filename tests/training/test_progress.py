"""The progress bar on a terminal, and plain lines elsewhere."""

import io
import re

from vit_jax.training import metric_writer, progress


class _Terminal(io.StringIO):
  def isatty(self):
    return True


def test_bar_shows_steps_rate_and_time_left_and_lines_print_above(capsys):
  terminal = _Terminal()
  clock = progress.Clock(0.0)
  with metric_writer.StatusLine(terminal) as status:
    bar = progress.ProgressBar(status, batch_size=32, start_step=0,
                               clock=clock, interval=0.0)
    bar.update(25, 100)
    drawn = terminal.getvalue().split("\r\033[K")[-1]
    match = re.fullmatch(
        r"\[(#*)(\.*)\] step 25/100  ([\d.]+) steps/s  ([\d,]+) images/s  "
        r"(\d+):(\d\d) left", drawn)
    assert match, drawn
    assert len(match.group(1)) == 6 and len(match.group(2)) == 18
    steps_per_s = float(match.group(3))
    assert steps_per_s > 0
    images_per_s = int(match.group(4).replace(",", ""))
    assert abs(images_per_s - 32 * steps_per_s) <= 32 * 0.05 + 1
    # A line logged meanwhile goes above the bar, which is drawn again.
    metric_writer.log("train step 25 | loss 1.0")
    assert capsys.readouterr().out == "train step 25 | loss 1.0\n"
    assert terminal.getvalue().endswith("\r\033[K" + drawn)
    bar.announce("evaluating at step 25")
    assert terminal.getvalue().endswith(" | evaluating at step 25")
  assert terminal.getvalue().endswith("\r\033[K")  # cleared at the end
  assert metric_writer._status_line is None  # pylint: disable=protected-access


def test_no_bar_off_a_terminal():
  pipe = io.StringIO()  # isatty() is False, as for a log file
  with metric_writer.StatusLine(pipe) as status:
    bar = progress.ProgressBar(status, batch_size=8, start_step=0,
                               clock=progress.Clock(0.0), interval=0.0)
    bar.update(5, 10)
    bar.announce("saving")
  assert pipe.getvalue() == ""
