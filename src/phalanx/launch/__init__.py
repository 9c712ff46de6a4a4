"""The launcher: user input -> LaunchSpec -> per-node setup -> torchrun's elastic agent.

Nothing here imports torch at module level. Design notes: docs/launch-design.md.
"""
