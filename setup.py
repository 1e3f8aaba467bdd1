"""What pyproject.toml cannot say yet without an experimental table: kv_aware's request path in
C (services/coordinator/kv/speedups.py). Optional: a machine without a C compiler still installs
Motor, and runs the Python the extension mirrors."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "services.coordinator.kv._speedups",
            ["services/coordinator/kv/_speedups.c"],
            optional=True,
        )
    ]
)
