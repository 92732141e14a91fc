// Package hypervisor probes, configures and supervises QEMU for kata-fsx.
//
// It builds the QEMU command line in the shape Kata Containers uses on x86_64
// (q35 or pc, shared guest memory for vhost-user devices, explicit PCI
// addresses so the guest PCI path of every device is known before boot),
// starts QEMU as a supervised child process and talks to it over QMP (see
// the qmp subpackage).
package hypervisor
