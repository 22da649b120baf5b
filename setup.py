"""The core's one native part, optional: a C compiler missing (or a processor without
CRC-32C instructions) leaves shmstage.readsum on its pure-Python path."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shmstage._readsum",
            ["shmstage/_readsum.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
