"""The Ray tests need the `ray` extra (CI installs it); without it they are left out, not errors."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("ray") else ["test_ray.py", "test_ray_nodes.py"]
