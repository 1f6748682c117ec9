package mqttapi

import (
	"bytes"
	"testing"

	"github.com/mochi-mqtt/server/v2/packets"
)

// TestCloneUserLeavesThePacket: mochi's decoded user properties point into
// the packet's buffer (writing the buffer changes them), so a pending
// PUBACK that kept them would keep the whole packet; the copy enqueue keeps
// does not change with it.
func TestCloneUserLeavesThePacket(t *testing.T) {
	var out bytes.Buffer
	in := packets.Packet{
		FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1}, TopicName: "kettles/x/measurements", PacketID: 7,
		Payload: []byte("[]"), ProtocolVersion: 5,
		Properties: packets.Properties{User: []packets.UserProperty{{Key: "trace", Val: "abc"}}},
	}
	if err := in.PublishEncode(&out); err != nil {
		t.Fatal(err)
	}
	buf := out.Bytes()
	var fh packets.FixedHeader
	if err := fh.Decode(buf[0]); err != nil {
		t.Fatal(err)
	}
	body := buf[2:] // remaining length fits one byte here
	pk := packets.Packet{FixedHeader: fh, ProtocolVersion: 5}
	if err := pk.PublishDecode(body); err != nil {
		t.Fatal(err)
	}
	kept := cloneUser(pk.Properties.User)
	i := bytes.Index(body, []byte("abc"))
	copy(body[i:], "XYZ")
	if pk.Properties.User[0].Val != "XYZ" {
		t.Logf("mochi copied the strings after all (%q): the copy is only belt and braces", pk.Properties.User[0].Val)
	}
	if kept[0].Key != "trace" || kept[0].Val != "abc" {
		t.Errorf("the copy changed with the packet buffer: %+v", kept)
	}
	if cloneUser(nil) != nil {
		t.Error("cloneUser(nil) allocated")
	}
}
