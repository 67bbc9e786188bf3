import fsdp_ckpt


def test_installs_and_imports_with_its_version():
    assert fsdp_ckpt.__version__ == "0.1.0"
