package qmp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
)

// Status is the result of query-status.
type Status struct {
	Running bool `json:"running"`
	// Status is QEMU's RunState, e.g. "running", "prelaunch", "paused", "shutdown".
	Status     string `json:"status"`
	Singlestep bool   `json:"singlestep"`
}

// QueryStatus returns the VM run state.
func (c *Client) QueryStatus(ctx context.Context) (Status, error) {
	var s Status
	err := c.Execute(ctx, "query-status", nil, &s)
	return s, err
}

// Cont starts the guest CPUs of a VM started paused (-S).
func (c *Client) Cont(ctx context.Context) error {
	return c.Execute(ctx, "cont", nil, nil)
}

// ChardevAddSocket adds a client-mode unix socket chardev, as vhost-user
// frontends need (the backend listens; QEMU connects immediately, so the
// backend must already be listening).
func (c *Client) ChardevAddSocket(ctx context.Context, id, path string) error {
	args := map[string]any{
		"id": id,
		"backend": map[string]any{
			"type": "socket",
			"data": map[string]any{
				"addr":   map[string]any{"type": "unix", "data": map[string]any{"path": path}},
				"server": false,
			},
		},
	}
	return c.Execute(ctx, "chardev-add", args, nil)
}

// ChardevRemove removes the chardev id.
func (c *Client) ChardevRemove(ctx context.Context, id string) error {
	return c.Execute(ctx, "chardev-remove", map[string]any{"id": id}, nil)
}

// DeviceAdd hot-plugs a device; props are the driver's properties (e.g. chardev, bus, addr).
func (c *Client) DeviceAdd(ctx context.Context, driver, id string, props map[string]any) error {
	args := make(map[string]any, len(props)+2)
	for k, v := range props {
		args[k] = v
	}
	if _, ok := args["driver"]; ok {
		return fmt.Errorf("qmp device_add %s: props must not set driver", id)
	}
	if _, ok := args["id"]; ok {
		return fmt.Errorf("qmp device_add %s: props must not set id", id)
	}
	args["driver"], args["id"] = driver, id
	return c.Execute(ctx, "device_add", args, nil)
}

// DeviceDel asks for removal of device id and waits for its DEVICE_DELETED
// event. PCI unplug needs the guest's cooperation (ACPI eject), so with no
// running guest this waits until ctx ends.
func (c *Client) DeviceDel(ctx context.Context, id string) error {
	sub := c.Subscribe("DEVICE_DELETED", func(ev Event) bool {
		var d struct {
			Device string `json:"device"`
		}
		return json.Unmarshal(ev.Data, &d) == nil && d.Device == id
	})
	if err := c.Execute(ctx, "device_del", map[string]any{"id": id}, nil); err != nil {
		sub.Cancel()
		return err
	}
	if _, err := sub.Wait(ctx); err != nil {
		return fmt.Errorf("qmp device_del %s: %w", id, err)
	}
	return nil
}

// SystemPowerdown presses the virtual power button (ACPI); the guest decides what to do.
func (c *Client) SystemPowerdown(ctx context.Context) error {
	return c.Execute(ctx, "system_powerdown", nil, nil)
}

// Quit asks QEMU to exit. QEMU may close the connection before or after its
// reply arrives; both count as success.
func (c *Client) Quit(ctx context.Context) error {
	err := c.Execute(ctx, "quit", nil, nil)
	if errors.Is(err, ErrClosed) {
		return nil
	}
	return err
}

// PCIDevice is one function in query-pci's answer.
type PCIDevice struct {
	Bus      int    `json:"bus"`
	Slot     int    `json:"slot"`
	Function int    `json:"function"`
	QdevID   string `json:"qdev_id"`
	// Bridge lists the devices behind this function when it is a PCI bridge.
	Bridge *struct {
		Bus struct {
			Number int `json:"number"`
		} `json:"bus"`
		Devices []PCIDevice `json:"devices"`
	} `json:"pci_bridge,omitempty"`
}

// PCIBus is one root bus in query-pci's answer.
type PCIBus struct {
	Bus     int         `json:"bus"`
	Devices []PCIDevice `json:"devices"`
}

// QueryPCI returns the PCI topology as QEMU sees it.
func (c *Client) QueryPCI(ctx context.Context) ([]PCIBus, error) {
	var buses []PCIBus
	err := c.Execute(ctx, "query-pci", nil, &buses)
	return buses, err
}

// FindPCIPath returns the slots from the root bus down to the device with
// qdev id, e.g. [2 1] for slot 1 behind the bridge in slot 2.
func FindPCIPath(buses []PCIBus, id string) ([]int, bool) {
	var walk func(devs []PCIDevice, prefix []int) ([]int, bool)
	walk = func(devs []PCIDevice, prefix []int) ([]int, bool) {
		for _, d := range devs {
			p := append(append([]int(nil), prefix...), d.Slot)
			if d.QdevID == id {
				return p, true
			}
			if d.Bridge != nil {
				if r, ok := walk(d.Bridge.Devices, p); ok {
					return r, true
				}
			}
		}
		return nil, false
	}
	for _, b := range buses {
		if r, ok := walk(b.Devices, nil); ok {
			return r, true
		}
	}
	return nil, false
}

// QOMGet reads property of the QOM object at path into result.
func (c *Client) QOMGet(ctx context.Context, path, property string, result any) error {
	return c.Execute(ctx, "qom-get", map[string]any{"path": path, "property": property}, result)
}
