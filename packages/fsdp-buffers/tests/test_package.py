import fsdp_buffers


def test_installs_and_imports_with_its_version():
    assert fsdp_buffers.__version__ == "0.1.0"
