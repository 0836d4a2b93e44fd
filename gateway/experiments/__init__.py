"""Engine A/B experiments: what each arm saw and the paired comparison, reported honestly."""

from gateway.experiments.report import (
    ExperimentRecord,
    Sample,
    paired_difference,
    percentile,
    render_report,
)

__all__ = ["ExperimentRecord", "Sample", "paired_difference", "percentile", "render_report"]
