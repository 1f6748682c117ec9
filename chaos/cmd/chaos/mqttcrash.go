package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/kettlefleet/kettlefleet"
)

// hostilePackets are malformed MQTT packets sent by an authenticated kettle
// after a valid MQTT 5 CONNECT. The first is what FuzzMQTTPacket found
// (chaos/testdata/crashers/): a SUBSCRIBE whose remaining length (5) ends
// inside its topic filter.
var hostilePackets = []struct {
	name string
	data []byte
}{
	{"SUBSCRIBE cut inside its filter (82 05 00 40 00 00 00)", []byte("\x82\x05\x00@\x00\x00\x00")},
	{"PUBLISH claiming 256 MB", []byte{0x32, 0xff, 0xff, 0xff, 0x7f}},
	{"UNSUBSCRIBE cut short", []byte{0xa2, 0x03, 0x00, 0x01, 0x00}},
	{"reserved packet type 0", []byte{0x00, 0x00}},
}

// mqttHostileRows sends each hostile packet to a real kettle serve with
// --mqtt-addr, on its own connection, and checks the process survives and
// still serves HTTP. Each is a row of the bad-input table.
func mqttHostileRows(ctx context.Context, e *env) []Row {
	dir := filepath.Join(e.out, "badinput-mqtt")
	os.RemoveAll(dir)
	data := filepath.Join(dir, "data")
	os.MkdirAll(data, 0o755)
	var rows []Row
	for _, hp := range hostilePackets {
		row := Row{Check: "MQTT packet to a real kettle serve: " + hp.name}
		addr, err := freeAddr()
		if err != nil {
			return append(rows, Row{Check: row.Check, Outcome: "FAIL", Detail: err.Error()})
		}
		maddr, _ := freeAddr()
		srv, err := startServe(ctx, e, addr, data, "sqlite:"+filepath.Join(data, "kettle.db"), filepath.Join(dir, "serve.log"), "--mqtt-addr", maddr)
		if err != nil {
			return append(rows, Row{Check: row.Check, Outcome: "FAIL", Detail: err.Error()})
		}
		detail, err := sendAfterConnect(maddr, readSecret(data, "secret"), hp.data)
		sleep(ctx, 500*time.Millisecond)
		switch {
		case err != nil:
			row.Outcome, row.Detail = "FAIL", "could not run: "+err.Error()
		case !srv.alive():
			row.Outcome = "FAIL"
			row.Detail = fmt.Sprintf("kettle serve DIED (%v): %s", srv.exitErr, detail)
			if b, _ := os.ReadFile(srv.logPath); bytes.Contains(b, []byte("panic:")) {
				i := bytes.LastIndex(b, []byte("panic:"))
				lines := strings.SplitN(string(b[i:]), "\n", 6)
				// panic line and the first frame: where it happened.
				row.Detail += "; " + lines[0]
				if len(lines) > 4 {
					row.Detail += " in " + strings.TrimSpace(lines[3]) + " " + strings.TrimSpace(lines[4])
				}
				row.Detail += " — a panic on a connection goroutine kills the whole process: every kettle (HTTP and MQTT) loses its server"
			}
		default:
			row.Outcome, row.Detail = "PASS", "server alive, "+detail
		}
		srv.stop()
		rows = append(rows, row)
	}
	return rows
}

// sendAfterConnect connects as a fresh kettle over MQTT 5, sends data, and
// says what came back.
func sendAfterConnect(addr, secret string, data []byte) (string, error) {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	id := uuid.New()
	pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect}, ProtocolVersion: 5}
	pk.Connect = packets.ConnectParams{ProtocolName: []byte("MQTT"), Clean: true, Keepalive: 30, ClientIdentifier: id.String(),
		UsernameFlag: true, Username: []byte(id.String()), PasswordFlag: true, Password: []byte(kettle.DeviceToken([]byte(secret), id))}
	var buf bytes.Buffer
	if err := pk.ConnectEncode(&buf); err != nil {
		return "", err
	}
	c.Write(buf.Bytes())
	br := bufio.NewReader(c)
	b, err := br.ReadByte()
	if err != nil || b>>4 != packets.Connack {
		return "", fmt.Errorf("no CONNACK (%v)", err)
	}
	n, _, err := packets.DecodeLength(br)
	if err != nil {
		return "", err
	}
	rest := make([]byte, n)
	if _, err := br.Read(rest); err != nil || len(rest) < 2 || rest[1] != 0 {
		return "", fmt.Errorf("CONNACK refused: % x", rest)
	}
	c.Write(data)
	c.SetReadDeadline(time.Now().Add(2 * time.Second))
	if _, err := br.ReadByte(); err != nil {
		return "connection closed or silent after the packet (" + shortErr(err) + ")", nil
	}
	return "answered the packet", nil
}

func shortErr(err error) string {
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		return "no answer within 2s"
	}
	return err.Error()
}
