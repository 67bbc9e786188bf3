import fsdp_hooks


def test_installs_and_imports_with_its_version():
    assert fsdp_hooks.__version__ == "0.1.0"
