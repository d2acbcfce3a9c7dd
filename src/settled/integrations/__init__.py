"""Drop-in adapters that run a harness's commands through settled, so each step has a receipt.

Each adapter imports its harness only in its own module: `import settled` never needs them.
- `settled.integrations.mini_swe_agent.SettledEnvironment`: a mini-swe-agent environment.
- `settled.integrations.inspect_ai`: the Inspect AI sandbox environment named "settled".
- `settled.integrations.fileops`: a harness's file reads and writes as commands inside a task's
  boundary (the Inspect sandbox's and `settled serve --swerex`'s); imports no harness.
"""
