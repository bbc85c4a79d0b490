"""The `selfspec` command line: its options, the commands that decode, and import/export/push."""
