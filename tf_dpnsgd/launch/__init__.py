"""absl-flag entry points: ``python -m tf_dpnsgd.launch.{quickstart,cifar10,sst2,mnist,sweep,privacy}``.

Flags are defined and read only in this package; the library takes plain arguments.
"""
