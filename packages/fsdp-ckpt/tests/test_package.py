import fsdp_ckpt


def test_installs_and_imports_with_its_version():
    assert fsdp_ckpt.__version__ == "0.1.0"


def test_does_not_import_the_hook_layer():
    # fsdp-ckpt works on any DTensor module; it sits beside fsdp-hooks, not above it.
    import subprocess
    import sys

    code = "import sys, fsdp_ckpt; assert 'fsdp_hooks' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
