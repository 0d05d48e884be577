"""One module per device: `ops_<name>.py` defines `create_device(name) -> Compiled`."""
