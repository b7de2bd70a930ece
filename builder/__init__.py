"""The builder: turns a target checkpoint and its DFlash drafter into deployable artifacts."""
