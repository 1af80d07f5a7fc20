"""Code environments: programs a model writes, run against tests in a sandbox (``env.CodeEnv``,
``sandbox.Sandbox``, ``problems``); Lean proofs checked by a Kimina Lean server (``lean.LeanEnv``)."""
