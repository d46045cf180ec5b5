"""The public API is frozen and documented."""

import inspect

import kerasmulti

PUBLIC = [
    "ClusterError",
    "DeviceError",
    "LaunchError",
    "OnDevice",
    "ParallelBackupAndRestore",
    "ParallelModel",
    "ParallelModelCheckpoint",
    "PlacementSummary",
    "available_devices",
    "device_scope",
    "initialize",
    "is_chief",
    "launch",
    "on_device",
    "parallel_predict",
    "parallelize",
    "placement_summary",
    "remap_devices",
    "simulate_devices",
    "strip_placement",
    "ThroughputMonitor",
    "unwrap",
]


def test_all_is_frozen():
    assert sorted(kerasmulti.__all__) == sorted(PUBLIC)


def test_every_public_name_has_a_docstring_with_an_example():
    for name in PUBLIC:
        obj = getattr(kerasmulti, name)
        doc = inspect.getdoc(obj) or ""
        assert doc, f"{name} has no docstring"
        assert "Example:" in doc, f"{name}'s docstring has no Example"
