"""/proc/cpuinfo reader. Fixtures (tests/edge/data/):

- cpuinfo_spr_8480c.txt: 16-vCPU KVM guest on a Xeon Platinum 8480C (Sapphire Rapids); flags line from a
  public lscpu of a Sapphire Rapids KVM guest.
- cpuinfo_icelake_8375c.txt: 8-vCPU AWS guest on a Xeon Platinum 8375C (Ice Lake); flags from a public
  /proc/cpuinfo of that CPU.
- cpuinfo_host_epyc_avx2.txt: this project's host, copied from /proc/cpuinfo.
- cpuinfo_graviton3.txt: 8 vCPUs of AWS Graviton3 (Neoverse V1, CPU part 0xd40); Features from public dumps.
- cpuinfo_rpi4.txt: Raspberry Pi 4 Model B (Cortex-A72, 64-bit kernel).
- cpuinfo_android_sm8150.txt: Snapdragon 855 phone (Kryo 485: 4 x 0x805 + 4 x 0x804).
"""

from pathlib import Path

import pytest

from edge.device.cpuinfo import cpu_flags, parse_cpuinfo, parse_meminfo
from edge.errors import InputError

DATA = Path(__file__).parent / "data"


def text(name: str) -> str:
    return (DATA / name).read_text()


def profile(name: str, meminfo: str | None = None):
    return parse_cpuinfo(text(name), meminfo=text(meminfo) if meminfo else None)


def test_sapphire_rapids_has_amx_and_is_class_amx():
    spr = profile("cpuinfo_spr_8480c.txt")
    assert spr.has_amx
    assert spr.has("amx_int8") and spr.has("avx512_bf16") and spr.has("avx512_fp16") and spr.has("avx_vnni")
    assert spr.isa_class == "amx"


def test_sapphire_rapids_guest_counts_16_threads_on_8_cores():
    spr = profile("cpuinfo_spr_8480c.txt")
    assert spr.logical_cpus.value == 16
    assert spr.physical_cores.value == 8
    assert spr.hypervisor.value is True


def test_sapphire_rapids_vendor_and_model_name():
    spr = profile("cpuinfo_spr_8480c.txt")
    assert spr.vendor.value == "Intel"
    assert spr.cpu_model.value == "Intel(R) Xeon(R) Platinum 8480C"
    assert spr.arch.value == "x86_64"


def test_ice_lake_is_avx512_without_amx_or_bf16():
    icx = profile("cpuinfo_icelake_8375c.txt")
    assert icx.isa_class == "avx512"
    assert icx.has("avx512_vnni")
    assert not icx.has("avx512_bf16")
    assert not icx.has("amx_tile")
    assert not icx.has("avx_vnni")


def test_ice_lake_guest_pairs_threads_by_core_id():
    icx = profile("cpuinfo_icelake_8375c.txt")
    assert (icx.logical_cpus.value, icx.physical_cores.value) == (8, 4)


def test_this_hosts_copy_has_avx2_and_no_avx512_or_amx():
    host = profile("cpuinfo_host_epyc_avx2.txt")
    assert host.has("avx2") and host.has("fma") and host.has("f16c")
    assert not host.has("avx512f")
    assert not host.has_amx
    assert host.isa_class == "avx2"
    assert host.vendor.value == "AMD"


def test_graviton3_is_arm_with_sve_i8mm_bf16_but_no_sve2():
    g3 = profile("cpuinfo_graviton3.txt")
    assert g3.isa_class == "arm"
    assert g3.arch.value == "aarch64"
    assert g3.isa.value == ["asimd", "asimddp", "asimdhp", "fphp", "sve", "i8mm", "bf16"]
    assert not g3.has("sve2")  # svebf16/svei8mm must not read as sve2


def test_graviton3_core_named_from_cpu_part():
    g3 = profile("cpuinfo_graviton3.txt")
    assert g3.cpu_model.value == "Neoverse-V1"
    assert g3.vendor.value == "ARM"


def test_arm_cpuinfo_leaves_physical_cores_and_hypervisor_unknown():
    g3 = profile("cpuinfo_graviton3.txt")
    assert g3.logical_cpus.value == 8
    assert not g3.physical_cores.known
    assert not g3.hypervisor.known


def test_raspberry_pi_4_has_asimd_but_no_dot_product():
    pi = profile("cpuinfo_rpi4.txt")
    assert pi.isa.value == ["asimd"]
    assert not pi.has("asimddp")
    assert pi.isa_class == "arm"


def test_raspberry_pi_named_by_its_model_line_and_not_a_phone():
    pi = profile("cpuinfo_rpi4.txt")
    assert pi.cpu_model.value == "Raspberry Pi 4 Model B Rev 1.4"
    assert not pi.is_phone


def test_android_cpuinfo_with_qualcomm_hardware_is_a_phone():
    phone = profile("cpuinfo_android_sm8150.txt")
    assert phone.is_phone
    assert phone.device_class.value == "phone"
    assert phone.os.value == "android"
    assert phone.cpu_model.value == "Qualcomm Technologies, Inc SM8150"
    assert phone.vendor.value == "Qualcomm"
    assert phone.has("asimddp") and not phone.has("sve")


def test_processors_listing_different_features_keep_only_the_common_ones():
    big_little = (
        "processor\t: 0\nFeatures\t: fp asimd asimddp i8mm\nCPU implementer\t: 0x41\nCPU architecture: 8\n\n"
        "processor\t: 1\nFeatures\t: fp asimd asimddp\nCPU implementer\t: 0x41\nCPU architecture: 8\n"
    )
    mixed = parse_cpuinfo(big_little)
    assert mixed.isa.value == ["asimd", "asimddp"]
    assert "intersection" in mixed.isa.detail


def test_meminfo_gives_total_and_available_in_bytes():
    pi = profile("cpuinfo_rpi4.txt", meminfo="meminfo_rpi4.txt")
    assert pi.memory_total_bytes.value == 3884300 * 1024
    assert pi.memory_available_bytes.value == 3472740 * 1024
    assert pi.memory_total_bytes.source == "meminfo"


def test_profile_says_it_came_from_cpuinfo_and_keeps_the_name():
    host = parse_cpuinfo(text("cpuinfo_host_epyc_avx2.txt"), name="gw-17")
    assert host.described_by == "cpuinfo"
    assert host.name == "gw-17"
    assert host.isa.source == "cpuinfo"


def test_cpu_flags_lists_every_flag_not_only_the_vocabulary():
    flags = cpu_flags(text("cpuinfo_icelake_8375c.txt"))
    assert {"avx512vl", "avx512dq", "hypervisor", "avx512f"} <= flags


@pytest.mark.parametrize(
    "garbage",
    ["", "hello world\n", "\x00\x01\x02binary", "MemTotal:  1024 kB\n", "flags : avx2\n"],
    ids=["empty", "prose", "binary", "meminfo", "flags-without-processor"],
)
def test_text_without_processor_entries_is_an_input_error_naming_cpuinfo(garbage):
    with pytest.raises(InputError) as error:
        parse_cpuinfo(garbage)
    assert error.value.field == "cpuinfo"
    assert "processor entry" in str(error.value)


def test_meminfo_without_memtotal_is_an_input_error_naming_meminfo():
    with pytest.raises(InputError) as error:
        parse_meminfo("MemFree: 12 kB\n")
    assert error.value.field == "meminfo"
