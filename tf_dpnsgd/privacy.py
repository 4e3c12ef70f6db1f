"""``python -m tf_dpnsgd.privacy``: epsilon / noise multiplier for a DP training setting.

The command-line tool lives in :mod:`tf_dpnsgd.launch.privacy` (flags are
defined only under ``tf_dpnsgd.launch``, so importing the library never
registers flags); this module is its ``-m`` entry point. The library API is
:mod:`tf_dpnsgd.accounting` and :class:`tf_dpnsgd.plan.PrivacyPlan`.
"""

if __name__ == "__main__":
  from absl import app

  from tf_dpnsgd.launch import privacy as _cli

  app.run(_cli.main)
