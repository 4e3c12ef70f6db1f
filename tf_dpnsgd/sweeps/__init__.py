"""Hyperparameter sweeps of a launcher, as a library: grid, runner, results, figures, report.

The command line is :mod:`tf_dpnsgd.launch.sweep` (it reads the flags and
calls these with plain arguments); docs/sweeps.md describes a sweep's files.

=============  ===========================================================================
``grid``       :class:`Axis`, :class:`Cell`, :func:`expand_grid`, :class:`SweepOptions`
``results``    the sweep folder, each cell's :class:`~tf_dpnsgd.records.RunRecord` as a
               row of ``results.csv``, :func:`robustness_summary` of a heatmap
``runner``     :func:`run_cells`: one subprocess of the base launcher per cell, resumable
``figures``    :func:`arrange_panels`, heatmaps per epsilon, training curves
``report``     :func:`summarize`: robustness and the privacy of tuning, per panel
``dry_run``    :func:`dry_run`: the cells' planned epsilon, without training
=============  ===========================================================================
"""

from tf_dpnsgd.sweeps.grid import (PANEL_AXIS, PRIVACY_FLAGS, RESERVED, SHORT_NAMES, VIRTUAL_AXES,
                                   X_CANDIDATES, Y_CANDIDATES, Axis, Cell, SweepError,
                                   SweepOptions, expand_grid, parse_fixed)
from tf_dpnsgd.sweeps.results import (FINISHED_MARKER, cell_dir, cell_result, is_finished,
                                      metric_value, read_record, robustness_summary,
                                      write_results)
from tf_dpnsgd.sweeps.runner import (cell_record, check_cell_record, check_cells, run_cell,
                                     run_cells)
from tf_dpnsgd.sweeps.figures import (Panel, arrange_panels, chosen_curve_cells, draw_curves,
                                      draw_heatmaps)
from tf_dpnsgd.sweeps.report import (assumptions, panel_privacy, report_lines, summarize,
                                     whole_sweep_privacy)
from tf_dpnsgd.sweeps.dry_run import dry_run, plan_cells

__all__ = [
    "Axis", "Cell", "FINISHED_MARKER", "PANEL_AXIS", "PRIVACY_FLAGS", "Panel", "RESERVED",
    "SHORT_NAMES", "SweepError", "SweepOptions", "VIRTUAL_AXES", "X_CANDIDATES", "Y_CANDIDATES",
    "arrange_panels", "assumptions", "cell_dir", "cell_record", "cell_result",
    "check_cell_record", "check_cells", "chosen_curve_cells", "draw_curves", "draw_heatmaps",
    "dry_run", "expand_grid", "is_finished", "metric_value", "panel_privacy", "parse_fixed",
    "plan_cells", "read_record", "report_lines", "robustness_summary", "run_cell", "run_cells",
    "summarize", "whole_sweep_privacy", "write_results",
]
