"""The dashboard's hit-ratio curve with prefix caching off: the GPU cache serves no prefix hits.

The engine then exports the GPU cache's capacity as 0 blocks
(kvcompose.instrumentation.economics), so the committed dashboard's marks,
evaluated by `promtool test rules`, put a tier of T blocks at T, where it
serves reuse distances [0, T), and the GPU cache nowhere.
"""

from __future__ import annotations

import json
from pathlib import Path

from .dashboard_support import COMMITTED_DASHBOARD, fill, query_and_scope, targets
from .test_dashboard_promql import HOT, M, RATE_INTERVAL, VALUES, expr_test, gauge, run_promtool


def test_with_prefix_caching_off_a_tier_is_marked_at_its_size_and_the_gpu_cache_not_at_all(tmp_path: Path) -> None:
    dashboard = json.loads(COMMITTED_DASHBOARD.read_text())
    marks = [fill(target.expr, VALUES, RATE_INTERVAL) for target in targets(dashboard)
             if query_and_scope(target.expr, ["hot", "cold"])[0].name == "capacity_marks"]
    curve = {256: 0.25, 512: 0.5, 768: 0.5625, 1024: 0.625}  # the grid holds the tier's size: its reach's end
    series = [
        *((f'kvcompose_cache_size_hit_ratio{{{M}, size_blocks="{size}"}}', gauge(ratio)) for size, ratio in curve.items()),
        (f'kvcompose_tier_capacity_blocks{{{M}, connector="gpu"}}', gauge(0)),
        (f"kvcompose_tier_capacity_blocks{{{HOT}}}", gauge(768)),
    ]
    assert marks
    run_promtool(series, [expr_test(expr, [({"connector": "hot", "size_blocks": "768"}, 0.5625)]) for expr in marks],
                 tmp_path)
