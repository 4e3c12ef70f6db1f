"""Offline stand-in for @rules_java//java:defs.bzl: the native Java rules, as is.

Bazel 4's @bazel_tools//tools/jdk (a registered toolchain package, loaded for
every target's toolchain resolution) loads these names from @rules_java, which
Bazel otherwise downloads from GitHub. This project builds no Java; the
WORKSPACE points @rules_java here so that `bazel test` works offline.
"""

def java_binary(**attrs):
    native.java_binary(**attrs)

def java_import(**attrs):
    native.java_import(**attrs)

def java_library(**attrs):
    native.java_library(**attrs)

def java_package_configuration(**attrs):
    native.java_package_configuration(**attrs)

def java_plugin(**attrs):
    native.java_plugin(**attrs)

def java_runtime(**attrs):
    native.java_runtime(**attrs)

def java_test(**attrs):
    native.java_test(**attrs)

def java_toolchain(**attrs):
    native.java_toolchain(**attrs)
